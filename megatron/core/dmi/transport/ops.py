"""The capture path as a ``torch.library`` custom op.

``dmi::ring_capture(ring, src, handle, site, mask)`` publishes ``src`` into the native ring
identified by ``handle`` under ``site``. ``ring`` is the transport's payload ring tensor and is
declared *mutated*: torch.compile therefore treats every call as a side effect on the ring, keeps
it, and keeps calls on one ring in program order (each depends on the previous one's mutation).
The op has no outputs; its fake implementation does nothing, so it traces without touching data.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from megatron.core.dmi.transport.base import TransportStateError

_lock = threading.Lock()
_handles = itertools.count(1)
_transports: dict[int, weakref.ref] = {}


def register_transport(transport) -> int:
    """Give a transport a handle the op can carry (an int is a valid custom-op argument)."""
    with _lock:
        h = next(_handles)
        _transports[h] = weakref.ref(transport)
    return h


def unregister_transport(handle: int) -> None:
    """Forget a transport's handle (when the transport closes)."""
    with _lock:
        _transports.pop(handle, None)


def _lookup(handle: int):
    ref = _transports.get(handle)
    t = ref() if ref is not None else None
    if t is None:
        raise TransportStateError(f"dmi::ring_capture: no open transport with handle {handle}")
    return t


@torch.library.custom_op("dmi::ring_capture", mutates_args=("ring",))
def ring_capture(ring: torch.Tensor, src: torch.Tensor, handle: int, site: int, mask: int = 1) -> None:
    """Publish ``src`` at ``site`` into the transport ``handle`` names (the custom op)."""
    _lookup(handle).publish_site(site, src, mask)


@ring_capture.register_fake
def _ring_capture_fake(ring, src, handle, site, mask=1):
    return None


def capture(transport, site: int, tensor: torch.Tensor, mask: int = 1) -> None:
    """Publish through the custom op (use this inside torch.compile'd or graph-captured code)."""
    torch.ops.dmi.ring_capture(transport.ring_tensor, tensor, transport.handle, site, mask)


__all__ = ["capture", "register_transport", "ring_capture", "unregister_transport"]
