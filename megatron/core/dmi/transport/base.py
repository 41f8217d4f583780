"""Transport contract: the training thread publishes tensors, the drain thread takes records.

A transport owns a fixed-size payload ring (device memory for CUDA tensors, host memory for CPU
tensors) and a descriptor queue. ``publish`` copies the tensor into a reserved slot on the current
stream and enqueues the record key with it; it never blocks on the device. ``take`` returns
finished records in publish order together with their host bytes and frees their ring space;
``take_table`` returns the same as one Arrow table in ``TENSOR_SCHEMA`` (what the drain hands the
sink; the native ring builds it without per-record Python objects).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import torch

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import Firing, RecordKey
from megatron.core.dmi.records import Record, records_to_table

OnFull = Literal["block", "drop"]


def capturing_graph() -> bool:
    """Is the current CUDA stream capturing a graph? Asked on every hook firing, so it asks
    ``is_initialized`` (module state) first rather than ``is_available`` (reads the environment):
    no stream captures before CUDA is initialised."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class RingTooSmallError(DMIError, ValueError):
    """A single record can never fit in the ring."""


class TransportInputError(DMIError, ValueError):
    """A tensor, key or argument a transport cannot take (wrong device, dtype, shape, phase, size)."""


class TransportStateError(DMIError, RuntimeError):
    """A transport call made in a state that forbids it (closed, spooling, inside graph capture)."""


class NativeRingError(DMIError, RuntimeError):
    """A native ring operation failed (a CUDA call, a closed ring, a spool write): raised by the
    C++ builds for their ``std::runtime_error``; their ``std::invalid_argument`` is a
    ``TransportInputError``."""


@dataclass
class TransportStats:
    """A transport's counters: records and bytes published, dropped, rejected, drained; time blocked."""

    published: int = 0
    published_bytes: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    rejected: int = 0  # occurrences refused by the gate (not captured, not counted as drops)
    drained: int = 0
    drained_bytes: int = 0
    blocked: int = 0  # on_full=block: records whose producer waited for ring space
    blocked_seconds: float = 0.0  # ... and how long, in total: training stood still that long


class Transport(ABC):
    """The ring between the training thread (``publish``) and the drain (``take``, ``take_table``)."""

    name: str

    def __init__(self, ring_bytes: int, on_full: OnFull, device: torch.device, *, block_timeout: float):
        """``ring_bytes`` holds at least one ``SLOT_ALIGN`` slot; under ``on_full="block"`` a producer
        waits at most ``block_timeout`` seconds for space, then drops its record (counted in
        ``stats.dropped``). DMIConfig checks all three (``ring_mb``, ``on_full``, ``block_timeout``)."""
        self.ring_bytes = ring_bytes
        self.on_full = on_full
        self.block_timeout = block_timeout
        self.device = device
        self.stats = TransportStats()

    def check_fits(self, nbytes: int) -> None:
        """Raise ``RingTooSmallError`` when a record of ``nbytes`` can never fit in the ring."""
        if nbytes > self.ring_bytes:
            raise RingTooSmallError(
                f"a record of {nbytes} bytes does not fit the {self.ring_bytes}-byte ring; raise --dmi-ring-mb"
            )

    @abstractmethod
    def publish(self, key: RecordKey, tensor: torch.Tensor) -> bool:
        """Copy ``tensor`` into the ring under ``key``. False if dropped (on_full='drop')."""

    def site_handle(self, site: RecordKey):
        """What ``publish_firing`` takes to name a capture site (``site`` is a ``RecordKey.site()``);
        a caller firing one site many times keeps it. This default is the site key itself."""
        return site

    def publish_firing(self, handle, tensor: torch.Tensor, firing: Firing) -> bool:
        """``publish`` for a site named by ``site_handle``: the path of a hook that fires every
        microbatch, without building a full key each time. The caller vouches that ``tensor``
        has the site's dtype and shape."""
        return self.publish(handle.fired(firing), tensor)

    def publish_firings(self, handles: list, tensors: list[torch.Tensor], firings: Firing | list[Firing]) -> list[bool]:
        """Several ``publish_firing`` calls as one, for the outputs of one hook firing (a transport
        may publish them together: the native ring on a GPU reserves and copies them in one pair of
        launches). ``firings``: one per record, or one ``Firing`` that every record shares. One result
        per record, in order."""
        if isinstance(firings, Firing):
            firings = [firings] * len(tensors)
        return [self.publish_firing(h, t, f) for h, t, f in zip(handles, tensors, firings)]

    @abstractmethod
    def take(self, max_records: int, timeout: float) -> list[Record]:
        """Finished records in publish order (at most ``max_records``), waiting up to ``timeout``
        seconds for the first one. Frees their ring space."""

    def take_table(self, max_records: int, timeout: float, min_bytes: int = 0) -> pa.Table | None:
        """``take`` as one table (None when nothing was finished in time). ``min_bytes`` lets a
        transport linger up to ``timeout`` for a fuller batch (a hint; this default ignores it)."""
        records = self.take(max_records, timeout)
        return records_to_table(records) if records else None

    @abstractmethod
    def pending(self) -> int:
        """Records published but not yet taken."""

    def settle(self) -> None:
        """Make every publish issued so far visible to ``pending``/``take`` (device work included)."""

    def close(self) -> None:
        """Release the ring; this default has nothing to release."""
        pass
