"""The numbers and codes Python and the native builds (``csrc/dmi``) must agree on, defined once on
this side and checked against the module's exported values every time a build is loaded: a
mismatch fails the load with both values named, never the data.

The C++ side defines each in one place too (``ring_protocol.h``) and exports it as a module
attribute of the same name (the enums as name -> code dicts, the take row's column order as a
tuple of names).
"""

from __future__ import annotations

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import Firing
from megatron.core.dmi.records import DESCRIPTOR_COLUMNS

SLOT_ALIGN = 256  # bytes per ring slot unit; keeps every slot aligned for vectorised producer copies
CTX_WORDS = 8  # words of the device context block: a firing's words and spare ones
FIRING_WORDS = len(Firing._fields)  # a firing's context words in a descriptor (iteration, ..., invocation)
MAX_GROUP = 8  # records reserved and copied by one publish_group call
DESC_BYTES = 64  # one descriptor in the descriptor ring
TAKE_COLUMNS = DESCRIPTOR_COLUMNS  # one take row's uint64 words, in this order (take_into, spool rows)
TAKE_WORDS = len(TAKE_COLUMNS)
ON_FULL = {"drop": 0, "block": 1}  # what a producer does when the ring is full; other codes are refused
PUBLISH_RESULT = {"rejected": -1, "dropped": 0, "accepted": 1, "timed_out": 2}  # one host producer call
ROUTER_DTYPE = {"float32": 0, "bfloat16": 1, "float16": 2}  # the router selection kernel's input dtypes
ROUTER_SELECT_MAX_K = 32  # the kernel's largest top-k ...
ROUTER_SELECT_MAX_EXPERTS = 4096  # ... and expert count; beyond them the torch reference runs

ACCEPTED = PUBLISH_RESULT["accepted"]

EXPECTED = {
    "SLOT_ALIGN": SLOT_ALIGN,
    "CTX_WORDS": CTX_WORDS,
    "FIRING_WORDS": FIRING_WORDS,
    "MAX_GROUP": MAX_GROUP,
    "DESC_BYTES": DESC_BYTES,
    "TAKE_WORDS": TAKE_WORDS,
    "TAKE_COLUMNS": TAKE_COLUMNS,
    "ON_FULL": ON_FULL,
    "PUBLISH_RESULT": PUBLISH_RESULT,
    "ROUTER_DTYPE": ROUTER_DTYPE,
    "ROUTER_SELECT_MAX_K": ROUTER_SELECT_MAX_K,
    "ROUTER_SELECT_MAX_EXPERTS": ROUTER_SELECT_MAX_EXPERTS,
}


class NativeABIError(DMIError, RuntimeError):
    """A native build was compiled with constants this Python package does not share."""


class OnFullError(DMIError, ValueError):
    """An ``on_full`` policy that no native build knows."""


def on_full_code(on_full: str) -> int:
    """The native code of an ``on_full`` policy; ``OnFullError`` for any other name."""
    try:
        return ON_FULL[on_full]
    except KeyError:
        raise OnFullError(f"on_full must be one of {sorted(ON_FULL)}, not {on_full!r}") from None


def check(module, build: str) -> None:
    """Raise ``NativeABIError`` unless ``module`` exports every value of ``EXPECTED`` equal to Python's."""
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
