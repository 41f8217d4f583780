"""The constants shared by Python and the native builds are checked when a build is loaded."""

import types

import pytest

from megatron.core.dmi.key import Firing
from megatron.core.dmi.transport import abi, jit
from megatron.core.dmi.transport.base import NativeRingError, TransportInputError


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


def test_the_host_build_binds_every_member_its_protocols_name():
    from megatron.core.dmi.transport import native_api

    mod = jit.load_host()
    protocols = (
        (native_api.HostModule, mod),
        (native_api.HostRing, mod.HostRing),
        (native_api.SpoolThread, mod.SpoolThread),
    )
    for proto, native in protocols:
        names = {n for klass in proto.__mro__ if klass.__module__ == native_api.__name__ for n in vars(klass)}
        names |= {n for klass in proto.__mro__ for n in getattr(klass, "__annotations__", {})}
        missing = [n for n in names if not n.startswith("_") and not hasattr(native, n)]
        assert not missing, (proto.__name__, missing)


def test_every_shared_enum_and_the_column_order_are_part_of_the_check():
    for name in ("ON_FULL", "PUBLISH_RESULT", "ROUTER_DTYPE", "TAKE_COLUMNS", "CTX_WORDS"):
        stale = types.SimpleNamespace(**abi.EXPECTED)
        value = getattr(stale, name)
        setattr(
            stale,
            name,
            dict(value, extra=9) if isinstance(value, dict) else value[::-1] if isinstance(value, tuple) else value + 1,
        )
        with pytest.raises(abi.NativeABIError, match=name):
            abi.check(stale, "host")


def test_an_unknown_on_full_is_an_error_in_python_and_in_the_build():
    with pytest.raises(abi.OnFullError, match="'spill'"):
        abi.on_full_code("spill")
    with pytest.raises(TransportInputError, match="on_full code 7"):  # a DMIError, from C++
        jit.load_host().HostRing(1 << 12, 64, 1 << 12, 7, 1.0)


def test_a_producer_takes_exactly_one_firings_context_words():
    ring = jit.load_host().HostRing(1 << 12, 64, 1 << 12, abi.ON_FULL["drop"], 1.0)
    try:
        with pytest.raises(TransportInputError, match=f"{abi.FIRING_WORDS} context words"):
            ring.publish(0, 0, 0, 1, [1, 2, 3])
        with pytest.raises(TransportInputError, match="publish_group"):
            ring.publish_group([0, 0], [0, 0], [0, 0], 1, [0] * abi.FIRING_WORDS)
        codes = ring.publish_group([0, 0], [0, 0], [0, 1], 1, list(range(2 * abi.FIRING_WORDS)))
        assert codes == [abi.ACCEPTED, abi.ACCEPTED]
        ring.set_gate(0)
        assert ring.publish_group([0], [0], [0], 1, [0] * abi.FIRING_WORDS) == [abi.PUBLISH_RESULT["rejected"]]
        ring.set_gate(1)
        rows = []
        for _ in range(50):  # the drain thread stages records one by one: take until both are there
            rows += ring.take(8, 1.0)
            if len(rows) >= 2:
                break
        assert [r[1:7] for r in rows] == [(0, 0, 1, 2, 3, 4), (1, 5, 6, 7, 8, 9)]
    finally:
        ring.close()
    with pytest.raises(NativeRingError, match="ring is closed"):
        ring.publish(0, 0, 0, 1, None)
