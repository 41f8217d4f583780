"""Pure-PyTorch transport: a preallocated ring tensor on the tensor's device, drained to pinned memory.

The producer (training thread) copies into a reserved ring slice on the current stream and records
a CUDA event; the drain thread waits for that event, copies the slice to pinned staging on its own
stream, and frees the space in order. Always available (no compiler needed); the native ring in
``native.py`` adds the device gate and CUDA-graph safety.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import torch

from megatron.core.dmi.key import RecordKey
from megatron.core.dmi.records import Record
from megatron.core.dmi.transport.abi import SLOT_ALIGN
from megatron.core.dmi.transport.base import OnFull, Transport


@dataclass
class _Slot:
    key: RecordKey
    offset: int
    nbytes: int
    end: int  # ring position (monotonic) after this slot, used to free space in order
    ready: torch.cuda.Event | None


def _align(n: int) -> int:
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class TorchRingTransport(Transport):
    """The pure-PyTorch ring: always available, and what ``auto`` falls back to when the native ring cannot build."""

    name = "torch"

    def __init__(self, ring_bytes: int, on_full: OnFull, device: torch.device, *, block_timeout: float):
        """Allocate the ring on ``device``, with a pinned staging buffer of the same size and a copy stream on CUDA."""
        super().__init__(ring_bytes, on_full, device, block_timeout=block_timeout)
        self.ring = torch.empty(ring_bytes, dtype=torch.uint8, device=device)
        self._cuda = self.ring.is_cuda
        self._staging = torch.empty(ring_bytes, dtype=torch.uint8, pin_memory=self._cuda) if self._cuda else None
        self._drain_stream = torch.cuda.Stream(device=device) if self._cuda else None
        # head/tail are monotonic byte positions; the ring offset is position % ring_bytes.
        self._head = 0
        self._tail = 0
        self._slots: collections.deque[_Slot] = collections.deque()
        self._cv = threading.Condition()

    def _reserve(self, nbytes: int) -> tuple[int, int] | None:
        """Ring offset and new head for a slot of ``nbytes``; None if it does not fit now."""
        size = _align(max(nbytes, 1))
        offset = self._head % self.ring_bytes
        skip = 0
        if offset + size > self.ring_bytes:  # never split a slot across the wrap
            skip = self.ring_bytes - offset
            offset = 0
        new_head = self._head + skip + size
        if new_head - self._tail > self.ring_bytes:
            return None
        return offset, new_head

    def publish(self, key: RecordKey, tensor: torch.Tensor) -> bool:
        """Reserve a slot and copy ``tensor`` into it asynchronously; False when dropped (ring full, after waiting up
        to ``block_timeout`` under ``block``)."""
        nbytes = key.nbytes
        self.check_fits(_align(max(nbytes, 1)))
        with self._cv:
            slot = self._reserve(nbytes)
            if slot is None and self.on_full == "block":
                t0 = time.perf_counter()
                deadline = t0 + self.block_timeout
                while slot is None and (left := deadline - time.perf_counter()) > 0:
                    self._cv.wait(left)
                    slot = self._reserve(nbytes)
                self.stats.blocked += 1
                self.stats.blocked_seconds += time.perf_counter() - t0
            if slot is None:
                self.stats.dropped += 1
                self.stats.dropped_bytes += nbytes
                return False
            offset, self._head = slot
        if nbytes:
            src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self.ring[offset : offset + nbytes].copy_(src, non_blocking=True)
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._cv:
            self._slots.append(_Slot(key, offset, nbytes, self._head, ready))
            self.stats.published += 1
            self.stats.published_bytes += nbytes
            self._cv.notify_all()
        return True

    def _copy_out(self, slots: list[_Slot]) -> list[bytes]:
        if not self._cuda:
            return [self.ring[s.offset : s.offset + s.nbytes].numpy().tobytes() for s in slots]
        with torch.cuda.stream(self._drain_stream):
            pos = 0
            spans = []
            for s in slots:
                s.ready.wait(self._drain_stream)
                self._staging[pos : pos + s.nbytes].copy_(self.ring[s.offset : s.offset + s.nbytes], non_blocking=True)
                spans.append((pos, s.nbytes))
                pos += s.nbytes
        self._drain_stream.synchronize()
        return [self._staging[p : p + n].numpy().tobytes() for p, n in spans]

    def take(self, max_records: int, timeout: float) -> list[Record]:
        """Copy out up to ``max_records`` records in publish order, waiting up to ``timeout`` for the first, and free
        their ring space."""
        with self._cv:
            if not self._slots:
                self._cv.wait(timeout)
            slots = []
            # The staging buffer equals the ring size, so any set of live slots fits in it.
            while self._slots and len(slots) < max_records:
                slots.append(self._slots.popleft())
        if not slots:
            return []
        payloads = self._copy_out(slots)
        with self._cv:
            self._tail = slots[-1].end
            self.stats.drained += len(slots)
            self.stats.drained_bytes += sum(s.nbytes for s in slots)
            self._cv.notify_all()
        return [Record(s.key, p) for s, p in zip(slots, payloads)]

    def pending(self) -> int:
        """Records published but not yet taken."""
        with self._cv:
            return len(self._slots)
