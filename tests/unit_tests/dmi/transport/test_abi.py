"""The constants shared by Python and the native builds are checked when a build is loaded."""

import types

import pytest

from megatron.core.dmi.key import Firing
from megatron.core.dmi.transport import abi, jit


def test_the_host_build_exports_every_shared_constant_with_pythons_value():
    mod = jit.load_host()
    for name, value in abi.EXPECTED.items():
        assert getattr(mod, name) == value, name
    assert abi.FIRING_WORDS == len(Firing._fields) and mod.CTX_WORDS >= abi.FIRING_WORDS


def test_a_build_that_disagrees_fails_the_load_naming_both_values():
    stale = types.SimpleNamespace(**dict(abi.EXPECTED, MAX_GROUP=abi.MAX_GROUP * 2))
    del stale.TAKE_WORDS
    with pytest.raises(abi.NativeABIError) as err:
        abi.check(stale, "host")
    msg = str(err.value)
    assert f"MAX_GROUP is {abi.MAX_GROUP * 2} in the host build and {abi.MAX_GROUP} in Python" in msg
    assert "TAKE_WORDS is missing" in msg and "SLOT_ALIGN" not in msg
