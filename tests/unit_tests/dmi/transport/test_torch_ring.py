import threading
import time

import pytest
import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import dtype_name
from megatron.core.dmi.transport.abi import SLOT_ALIGN
from megatron.core.dmi.transport.base import RingTooSmallError
from megatron.core.dmi.transport.torch_ring import TorchRingTransport

CPU = torch.device("cpu")


def key(t: torch.Tensor, i: int) -> RecordKey:
    return RecordKey(
        "run",
        "train",
        i,
        0,
        0,
        0,
        0,
        "router.logits",
        ParallelCoords(),
        0,
        1,
        0,
        t.shape[0],
        t.shape[0],
        dtype_name(t.dtype),
        tuple(t.shape),
    )


def tensor(i: int, rows: int = 16) -> torch.Tensor:
    return torch.full((rows, 4), float(i))


def test_records_come_back_in_order_with_their_keys_and_bytes():
    ring = TorchRingTransport(4 * SLOT_ALIGN, "block", CPU, block_timeout=DMIConfig.block_timeout)
    for i in range(3):
        assert ring.publish(key(tensor(i), i), tensor(i))
    out = ring.take(10, 0)
    assert [r.key.iteration for r in out] == [0, 1, 2]
    assert all(torch.equal(r.tensor(), tensor(r.key.iteration)) for r in out)
    assert ring.pending() == 0 and ring.stats.drained == 3


def test_wrap_around_keeps_every_payload_intact():
    ring = TorchRingTransport(
        3 * SLOT_ALIGN, "drop", CPU, block_timeout=DMIConfig.block_timeout
    )  # 256-byte records: 3 fit
    seen = []
    for i in range(20):
        assert ring.publish(key(tensor(i), i), tensor(i))
        if i % 2:
            seen += ring.take(10, 0)
    seen += ring.take(10, 0)
    assert [r.key.iteration for r in seen] == list(range(20))
    assert all(torch.equal(r.tensor(), tensor(r.key.iteration)) for r in seen)


def test_drop_mode_counts_what_does_not_fit():
    ring = TorchRingTransport(2 * SLOT_ALIGN, "drop", CPU, block_timeout=DMIConfig.block_timeout)
    results = [ring.publish(key(tensor(i), i), tensor(i)) for i in range(5)]
    assert results == [True, True, False, False, False]
    assert ring.stats.dropped == 3 and ring.stats.dropped_bytes == 3 * 256
    assert [r.key.iteration for r in ring.take(10, 0)] == [0, 1]


def test_block_mode_waits_for_the_drain():
    ring = TorchRingTransport(2 * SLOT_ALIGN, "block", CPU, block_timeout=DMIConfig.block_timeout)
    got = []

    def drain():
        while len(got) < 6:
            got.extend(ring.take(1, 0.01))
            time.sleep(0.01)

    t = threading.Thread(target=drain)
    t.start()
    for i in range(6):
        assert ring.publish(key(tensor(i), i), tensor(i))
    t.join(5)
    assert [r.key.iteration for r in got] == list(range(6))
    assert ring.stats.dropped == 0 and ring.stats.blocked_seconds > 0


def test_zero_row_record_is_published():
    ring = TorchRingTransport(SLOT_ALIGN, "drop", CPU, block_timeout=DMIConfig.block_timeout)
    empty = torch.empty(0, 4)
    assert ring.publish(key(empty, 7), empty)
    (rec,) = ring.take(1, 0)
    assert rec.payload == b"" and rec.tensor().shape == (0, 4)


def test_record_larger_than_ring_is_refused():
    ring = TorchRingTransport(SLOT_ALIGN, "block", CPU, block_timeout=DMIConfig.block_timeout)
    with pytest.raises(RingTooSmallError, match="--dmi-ring-mb"):
        ring.publish(key(tensor(0, 32), 0), tensor(0, 32))


def test_block_mode_gives_up_after_the_timeout_and_counts_a_drop():
    ring = TorchRingTransport(SLOT_ALIGN, "block", CPU, block_timeout=0.2)
    assert ring.publish(key(tensor(0), 0), tensor(0))
    t0 = time.perf_counter()
    assert not ring.publish(key(tensor(1), 1), tensor(1))  # nothing drains: the ring stays full
    assert time.perf_counter() - t0 >= 0.2
    assert ring.stats.dropped == 1 and ring.stats.blocked == 1 and ring.stats.blocked_seconds >= 0.2
    assert [r.key.iteration for r in ring.take(10, 0)] == [0]
