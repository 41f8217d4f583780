"""Host build of the native ring: the protocol shared with the CUDA build, tested on CPU tensors."""

import random
import threading
import time

import pytest
import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import dtype_name
from megatron.core.dmi.transport import open_transport
from megatron.core.dmi.transport.abi import SLOT_ALIGN
from megatron.core.dmi.transport.base import RingTooSmallError
from megatron.core.dmi.transport.native import NativeRingTransport
from tests.unit_tests.dmi.transport.ring import drain_all, ring_state

CPU = torch.device("cpu")


def key_for(
    t: torch.Tensor,
    iteration: int = 1,
    *,
    layer: int = 0,
    output: str = "router.logits",
    microbatch: int = 0,
    phase: str = "train",
    invocation: int = 0,
    attempt: int = 0,
) -> RecordKey:
    rows = t.shape[0] if t.dim() else 1
    return RecordKey(
        "run",
        phase,
        iteration,
        attempt,
        microbatch,
        invocation,
        layer,
        output,
        ParallelCoords(rank=3, tp=1),
        0,
        1,
        0,
        rows,
        rows,
        dtype_name(t.dtype),
        tuple(t.shape),
    )


def ring(nbytes, on_full="drop", block_timeout=DMIConfig.block_timeout, **kw) -> NativeRingTransport:
    return NativeRingTransport(nbytes, on_full, CPU, block_timeout=block_timeout, **kw)


def slot_tensor(i: int) -> torch.Tensor:
    return torch.full((64,), float(i))  # exactly one 256-byte slot


def test_round_trip_keeps_keys_bytes_and_order():
    r = ring(8 * SLOT_ALIGN)
    keys = []
    for i in range(5):
        t = slot_tensor(i)
        k = key_for(t, iteration=i + 1, layer=i % 2, microbatch=i, phase=("train", "valid")[i % 2], invocation=i % 2)
        keys.append(k)
        assert r.publish(k, t)
    r.sync_drain()
    out = r.take_with_seq(100, 1.0)
    assert [s for s, _ in out] == list(range(5))
    assert [rec.key for _, rec in out] == keys
    assert all(torch.equal(rec.tensor(), slot_tensor(i)) for i, (_, rec) in enumerate(out))
    st = r.stats
    assert (st.published, st.drained, st.dropped, st.rejected) == (5, 5, 0, 0)
    assert r.pending() == 0
    r.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_payloads_are_bitwise_identical(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    raw = torch.randint(-(2**31), 2**31 - 1, (rows, 5), dtype=torch.int64, generator=g)
    t = raw.to(torch.int32).view(torch.float32).to(dtype) if dtype.is_floating_point else raw.to(dtype)
    if dtype.is_floating_point:  # arbitrary bit patterns, NaNs and infinities included
        nb = t.numel() * t.element_size()
        bits = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
        t = bits.view(dtype).reshape(rows, 5) if nb else torch.empty((rows, 5), dtype=dtype)
    r = ring(max(4 * SLOT_ALIGN, 2 * t.numel() * t.element_size()))
    assert r.publish(key_for(t), t)
    (rec,) = drain_all(r)
    assert rec.key.shape == (rows, 5) and rec.key.dtype == dtype_name(dtype)
    assert len(rec.payload) == t.numel() * t.element_size()
    got = rec.tensor()
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got.view(torch.uint8) if rows else got, t.view(torch.uint8) if rows else t)
    r.close()


def test_non_contiguous_tensor_is_published_in_c_order():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    r = ring(4 * SLOT_ALIGN)
    assert r.publish(key_for(t), t)
    (rec,) = drain_all(r)
    assert torch.equal(rec.tensor(), t.contiguous())


def test_wrap_around_with_uneven_slots_keeps_every_payload_intact():
    r = ring(5 * SLOT_ALIGN, staging_bytes=5 * SLOT_ALIGN)
    sizes = [64, 128, 64, 192, 32, 128, 64, 64, 160, 96] * 4  # float32 elements: 1, 2, 1, 3, ... slots
    seen = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(i))
        assert r.publish(key_for(t, iteration=i), t), i
        r.sync_drain()
        seen += r.take(100, 0.0)
    seen += drain_all(r)
    assert [rec.key.iteration for rec in seen] == list(range(len(sizes)))
    for i, rec in enumerate(seen):
        assert torch.equal(rec.tensor(), torch.full((sizes[i],), float(i)))
    state = ring_state(r)
    assert state["head"] > 5 * state["capacity"]  # went round the ring several times
    assert state["tail"] == state["head"]
    assert r.stats.dropped == 0


def test_full_ring_in_drop_mode_drops_and_counts_then_recovers():
    r = ring(4 * SLOT_ALIGN, "drop", staging_bytes=4 * SLOT_ALIGN)
    for i in range(4):
        assert r.publish(key_for(slot_tensor(i), i), slot_tensor(i))
    assert r.sync_drain()  # the drain moves all four to staging and frees the ring
    for i in range(4, 8):
        assert r.publish(key_for(slot_tensor(i), i), slot_tensor(i))
    assert r.sync_drain()  # staging full: these stay in the ring
    st = ring_state(r)
    assert not r.publish(key_for(slot_tensor(8), 8), slot_tensor(8))
    assert not r.publish(key_for(slot_tensor(9), 9), slot_tensor(9))
    after = ring_state(r)
    assert (after["head"], after["published"]) == (st["head"], st["published"])  # nothing consumed
    s = r.stats
    assert (s.published, s.dropped, s.dropped_bytes) == (8, 2, 2 * 256)
    # a zero-byte record needs no payload space: it still fits in a full payload ring
    z = torch.empty((0, 4))
    assert r.publish(key_for(z, 100), z)
    out = drain_all(r)
    assert [rec.key.iteration for rec in out] == [0, 1, 2, 3, 4, 5, 6, 7, 100]
    assert out[-1].payload == b"" and out[-1].tensor().shape == (0, 4)
    assert r.publish(key_for(slot_tensor(10), 10), slot_tensor(10))  # space again
    assert [rec.key.iteration for rec in drain_all(r)] == [10]
    assert r.stats.dropped == 2


def test_full_ring_in_block_mode_waits_for_the_consumer():
    r = ring(2 * SLOT_ALIGN, "block", staging_bytes=2 * SLOT_ALIGN)
    n = 12
    done = threading.Event()

    def produce():
        for i in range(n):
            assert r.publish(key_for(slot_tensor(i), i), slot_tensor(i))
        done.set()

    th = threading.Thread(target=produce)
    th.start()
    time.sleep(0.3)
    assert not done.is_set()  # ring + staging hold 4 records; the producer waits for space
    assert r.pending() == 4
    got = []
    while len(got) < n:
        got += r.take(1, 2.0)  # a slow consumer
        time.sleep(0.01)
    th.join(5)
    assert done.is_set()
    assert [rec.key.iteration for rec in got] == list(range(n))
    assert all(torch.equal(rec.tensor(), slot_tensor(i)) for i, rec in enumerate(got))
    s = r.stats
    assert (s.published, s.dropped) == (n, 0) and s.blocked_seconds > 0.1
    assert 1 <= s.blocked <= n - 2  # the first two fit the empty ring without waiting


def test_block_mode_gives_up_after_the_timeout_and_counts_a_drop():
    r = ring(SLOT_ALIGN, "block", staging_bytes=SLOT_ALIGN, block_timeout=0.2)
    for i in range(2):  # one in staging, one in the ring
        assert r.publish(key_for(slot_tensor(i), i), slot_tensor(i))
        r.sync_drain()
    t0 = time.perf_counter()
    assert not r.publish(key_for(slot_tensor(2), 2), slot_tensor(2))
    assert time.perf_counter() - t0 > 0.15  # it waited for its block timeout before dropping
    assert ring_state(r)["timeouts"] == 1 and r.stats.dropped == 1
    assert r.stats.blocked == 1 and r.stats.blocked_seconds > 0.15  # the wait is counted, drop or not
    assert [rec.key.iteration for rec in drain_all(r)] == [0, 1]


def test_rejected_gate_leaves_the_ring_unchanged():
    r = ring(4 * SLOT_ALIGN)
    t = slot_tensor(1)
    assert r.publish(key_for(t, 1), t)
    r.sync_drain()
    before = ring_state(r)
    r.set_gate(False)
    assert r.gate() == 0
    for i in range(5):
        assert not r.publish(key_for(t, 2 + i), t)
    z = torch.empty((0, 4))
    assert not r.publish(key_for(z, 9), z)  # zero-byte occurrences are gated too
    after = ring_state(r)
    for field in ("head", "tail", "desc_tail", "published", "published_bytes", "dropped", "drained"):
        assert after[field] == before[field], field
    assert after["rejected"] == 6
    assert r.stats.rejected == 6 and r.stats.dropped == 0
    r.set_gate(True)
    assert r.publish(key_for(t, 20), t)
    assert [rec.key.iteration for rec in drain_all(r)] == [1, 20]


def test_gate_word_and_producer_mask():
    r = ring(4 * SLOT_ALIGN)
    site = r.register_site(key_for(slot_tensor(0)))
    r.set_gate_word(0b10)  # e.g. "replays only"
    assert not r.publish_site(site, slot_tensor(1), mask=0b01)
    assert r.publish_site(site, slot_tensor(2), mask=0b10)
    assert [torch.equal(rec.tensor(), slot_tensor(2)) for rec in drain_all(r)] == [True]
    assert r.stats.rejected == 1


def test_keys_come_from_the_descriptor_context_block():
    r = ring(16 * SLOT_ALIGN)
    templates = [
        key_for(slot_tensor(0), layer=layer, output=out)
        for layer in (0, 5)
        for out in ("router.logits", "attn.context")
    ]
    sites = [r.register_site(t) for t in templates]
    assert len(set(sites)) == 4
    assert r.register_site(key_for(slot_tensor(0), iteration=77, layer=5, output="attn.context")) == sites[3]
    expected = []
    for it in (3, 4):
        for mb in (0, 1):
            r.set_context(iteration=it, microbatch=mb, attempt=2, phase="valid", invocation=mb)
            for s in sites:
                assert r.publish_site(s, slot_tensor(it * 100 + mb * 10 + s))
                expected.append((it, mb, s))
    assert r.context() == {"iteration": 4, "microbatch": 1, "attempt": 2, "phase": 1, "invocation": 1}
    out = drain_all(r)
    assert len(out) == len(expected)
    template_of = dict(zip(sites, templates))
    for rec, (it, mb, s) in zip(out, expected):
        tmpl = template_of[s]
        assert (rec.key.iteration, rec.key.microbatch, rec.key.attempt, rec.key.phase, rec.key.invocation) == (
            it,
            mb,
            2,
            "valid",
            mb,
        )
        assert (rec.key.layer, rec.key.output, rec.key.coords) == (tmpl.layer, tmpl.output, tmpl.coords)
        assert torch.equal(rec.tensor(), slot_tensor(it * 100 + mb * 10 + s))


def test_keys_survive_concurrent_producers_and_out_of_order_take():
    r = ring(8 * SLOT_ALIGN, "block", staging_bytes=8 * SLOT_ALIGN)
    per_thread, threads = 40, 4

    def produce(tid):
        for i in range(per_thread):
            it = tid * 1000 + i
            t = torch.tensor([float(it), float(tid), float(i)] + [0.0] * 61)
            assert r.publish(key_for(t, it, layer=tid, microbatch=i % 3), t)

    ths = [threading.Thread(target=produce, args=(k,)) for k in range(threads)]
    for th in ths:
        th.start()
    got = []
    rng = random.Random(0)
    while len(got) < per_thread * threads:
        got += r.take_with_seq(rng.randint(1, 7), 2.0)
    for th in ths:
        th.join()
    assert [s for s, _ in got] == list(range(per_thread * threads))  # one global sequence, no gaps
    rng.shuffle(got)  # consumers may reorder freely: every key still matches its own payload
    for _, rec in got:
        it, tid, i = rec.tensor()[:3].tolist()
        assert (rec.key.iteration, rec.key.layer, rec.key.microbatch) == (int(it), int(tid), int(i) % 3)
    per_producer = {}
    for _seq, rec in sorted(got, key=lambda x: x[0]):
        per_producer.setdefault(rec.key.layer, []).append(rec.key.iteration)
    assert all(v == sorted(v) for v in per_producer.values())  # each producer's order is kept


def test_record_larger_than_the_ring_is_refused():
    r = ring(2 * SLOT_ALIGN)
    t = torch.zeros(200)
    with pytest.raises(RingTooSmallError):
        r.publish(key_for(t), t)
    with pytest.raises(ValueError, match="multiple of 256"):  # the C++ ring's own invariant
        ring(100)


def test_mismatched_key_and_device_are_refused():
    r = ring(4 * SLOT_ALIGN)
    with pytest.raises(ValueError):
        r.publish(key_for(torch.zeros(3, 4)), torch.zeros(4, 3))


def test_take_waits_up_to_timeout_and_close_is_idempotent():
    r = ring(4 * SLOT_ALIGN)
    t0 = time.perf_counter()
    assert r.take(10, 0.2) == []
    assert 0.15 < time.perf_counter() - t0 < 3
    r.close()
    r.close()
    assert r.stats.published == 0


@pytest.mark.parametrize("on_full", ["block", "drop"])
def test_open_transport_hands_on_full_and_the_block_timeout_to_the_native_ring(on_full):
    cfg = DMIConfig(transport="native", ring_mb=SLOT_ALIGN / (1 << 20), on_full=on_full, block_timeout=0.2)
    r = open_transport(cfg, CPU)
    assert isinstance(r, NativeRingTransport)
    for i in range(2):  # one in staging, one in the ring
        assert r.publish(key_for(slot_tensor(i), i), slot_tensor(i))
        r.sync_drain()
    t0 = time.perf_counter()
    assert not r.publish(key_for(slot_tensor(2), 2), slot_tensor(2))
    if on_full == "block":  # the C++ ring waited for the config's timeout, then dropped
        assert time.perf_counter() - t0 > 0.15 and ring_state(r)["timeouts"] == 1
    else:
        assert ring_state(r)["timeouts"] == 0
    assert r.stats.dropped == 1
    r.close()


def test_open_transport_gives_the_native_ring_on_cpu():
    cfg = DMIConfig(hooks=frozenset({"router"}), transport="native", ring_mb=0.01, on_full="drop")
    tr = open_transport(cfg, CPU)
    assert isinstance(tr, NativeRingTransport) and tr.ring_bytes % SLOT_ALIGN == 0
    t = torch.arange(10, dtype=torch.int32)
    assert tr.publish(key_for(t, 5), t)
    (rec,) = drain_all(tr)
    assert torch.equal(rec.tensor(), t)
    tr.close()
