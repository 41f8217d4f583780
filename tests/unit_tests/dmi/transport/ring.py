"""What tests read off a native ring beyond its public API: its raw counters, and everything
published so far as records."""

import time

from megatron.core.dmi.records import Record
from megatron.core.dmi.transport.native import NativeRingTransport


def ring_state(ring: NativeRingTransport) -> dict:
    """Raw ring counters and positions (head/tail/seq, timeouts, drain batches, capacities)."""
    return dict(ring._ring.stats())


def drain_all(ring: NativeRingTransport, timeout: float = 10.0) -> list[Record]:
    """Every record published so far, taken within ``timeout`` seconds."""
    out: list[Record] = []
    deadline = time.monotonic() + timeout
    ring.sync_drain(timeout)
    while ring.pending() > 0 and time.monotonic() < deadline:
        out.extend(ring.take(1 << 20, min(0.05, max(0.0, deadline - time.monotonic()))))
    return out
