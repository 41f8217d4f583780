"""The numbers Python and the native builds (``csrc/dmi``) must agree on, defined once on this
side and checked against the module's exported constants every time a build is loaded: a mismatch
fails the load with both values named, never the data.

The C++ side defines each in one place too (``ring_protocol.h``, ``spool_writer.h``) and exports
it as a module attribute of the same name.
"""

from __future__ import annotations

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import Firing
from megatron.core.dmi.records import DESCRIPTOR_COLUMNS

SLOT_ALIGN = 256  # bytes per ring slot unit; keeps every slot aligned for vectorised producer copies
FIRING_WORDS = len(Firing._fields)  # a firing's context words in a descriptor (iteration, ..., invocation)
MAX_GROUP = 8  # records reserved and copied by one pair of launches (publish_group)
DESC_BYTES = 64  # one descriptor in the descriptor ring
TAKE_WORDS = len(DESCRIPTOR_COLUMNS)  # uint64 words per descriptor row handed to Python and spooled

EXPECTED = {
    "SLOT_ALIGN": SLOT_ALIGN,
    "FIRING_WORDS": FIRING_WORDS,
    "MAX_GROUP": MAX_GROUP,
    "DESC_BYTES": DESC_BYTES,
    "TAKE_WORDS": TAKE_WORDS,
}


class NativeABIError(DMIError, RuntimeError):
    """A native build was compiled with constants this Python package does not share."""


def check(module, build: str) -> None:
    """Raise ``NativeABIError`` unless ``module`` exports every constant of ``EXPECTED`` with the
    same value."""
    wrong = [
        f"{name} is {getattr(module, name, 'missing')} in the {build} build and {value} in Python"
        for name, value in EXPECTED.items()
        if getattr(module, name, None) != value
    ]
    if wrong:
        raise NativeABIError(
            f"the DMI {build} ring does not match this megatron-dmi: {'; '.join(wrong)} "
            f"(a stale or foreign build: clear TORCH_EXTENSIONS_DIR and rebuild)"
        )
