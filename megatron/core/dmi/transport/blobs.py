"""Reusable host buffers that the drain copies taken payloads into (the zero-copy consumer).

A batch of records leaves the transport as one contiguous buffer plus offsets; the Arrow table of
the batch views that buffer directly (``pa.foreign_buffer``), so no per-record Python object and no
second copy is made before Parquet writes it. Buffers are pooled because a fresh large allocation
page-faults on first touch (measured at 0.1 GB/s on the CI VM, a few GB/s on bare metal), while a
reused one runs at memcpy speed. A buffer returns to the pool when the last Arrow buffer over it is
released, whoever holds it (sink buffers, writer threads).
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa

from megatron.core.dmi.errors import InvalidArgumentError


class BlobLease:
    """One pooled buffer, lent until this object (and every Arrow buffer made from it) is gone."""

    def __init__(self, pool: BlobPool, array: np.ndarray):
        """Lend ``array`` of ``pool``, noting its address and size."""
        self._pool = pool
        self.array = array
        self.address = int(array.ctypes.data)
        self.nbytes = int(array.nbytes)

    def buffer(self, size: int) -> pa.Buffer:
        """The first ``size`` bytes as an Arrow buffer that keeps this lease alive."""
        if not 0 <= size <= self.nbytes:
            raise InvalidArgumentError(f"{size} bytes asked of a {self.nbytes}-byte buffer")
        return pa.foreign_buffer(self.address, size, base=self)

    def __del__(self):
        """Give the buffer back to the pool."""
        self._pool._give_back(self.array)


class BlobPool:
    """Buffers of at least ``default_bytes``; keeps up to ``keep`` free ones for reuse."""

    def __init__(self, default_bytes: int, keep: int = 4):
        """An empty pool of buffers of at least ``default_bytes``, keeping up to ``keep`` free ones."""
        self.default_bytes = int(default_bytes)
        self.keep = int(keep)
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever allocated (reuse shows as allocated << leases)
        self.leases = 0

    def lease(self, nbytes: int = 0) -> BlobLease:
        """A buffer of at least ``nbytes`` and ``default_bytes``: a free one large enough, else a new one."""
        want = max(int(nbytes), self.default_bytes)
        with self._lock:
            self.leases += 1
            for i, arr in enumerate(self._free):
                if arr.nbytes >= want:
                    return BlobLease(self, self._free.pop(i))
            self.allocated += 1
        return BlobLease(self, np.empty(want, dtype=np.uint8))

    def _give_back(self, array: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep and array.nbytes <= 4 * self.default_bytes:
                self._free.append(array)
