"""The zero-copy consumer: ``take_table`` returns the same records as ``take`` (keys, bytes,
checksums), as one Arrow table over pooled buffers."""

import gc
import zlib

import pytest
import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.records import TENSOR_SCHEMA, records_to_table
from megatron.core.dmi.transport.native import NativeRingTransport
from tests.unit_tests.dmi.tables import table_to_records
from tests.unit_tests.dmi.transport.test_native_ring import key_for

CPU = torch.device("cpu")


def publish_mixed(r: NativeRingTransport, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows = [0, 1, 3, 50, 700][i % 5]
        t = torch.randn(rows, 4, generator=g).to([torch.float32, torch.bfloat16, torch.float16][i % 3])
        k = key_for(
            t,
            iteration=i // 4 + 1,
            layer=i % 3,
            microbatch=i % 4,
            phase=("train", "valid")[i % 2],
            invocation=i % 2,
            attempt=i % 3,
            output=("router.logits", "attn.context")[i % 2],
        )
        assert r.publish(k, t)
        out.append((k, t))
    r.sync_drain()
    return out


def test_take_table_matches_take_bitwise():
    a = NativeRingTransport(1 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    b = NativeRingTransport(1 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    sent = publish_mixed(a, 40)
    publish_mixed(b, 40)
    table = a.take_table(1000, 1.0)
    assert table.schema == TENSOR_SCHEMA and table.num_rows == 40
    expected = records_to_table(b.take(1000, 1.0))
    assert table.equals(expected)  # keys, nbytes, crc32 checksums and payload bytes
    for (k, t), rec in zip(sent, table_to_records(table)):
        assert rec.key == k and torch.equal(rec.tensor().view(torch.uint8), t.contiguous().view(torch.uint8))
    assert a.pending() == 0 and a.take_table(10, 0.0) is None
    a.close()
    b.close()


def test_max_records_and_order_across_calls():
    r = NativeRingTransport(1 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    sent = publish_mixed(r, 25)
    got = []
    while r.pending():
        t = r.take_table(7, 0.5)
        assert t.num_rows <= 7
        got += table_to_records(t)
    assert [g.key for g in got] == [k for k, _ in sent]
    r.close()


def test_record_larger_than_the_pooled_buffer_gets_its_own(monkeypatch):
    monkeypatch.setattr(NativeRingTransport, "TAKE_BUFFER_BYTES", 4096)
    r = NativeRingTransport(1 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    small, big = torch.arange(16, dtype=torch.float32), torch.randn(8192)  # 64 B, 32 KiB
    for t in (small, big, small):
        r.publish(key_for(t), t)
    r.sync_drain()
    tables = [r.take_table(10, 0.5) for _ in range(3)]
    assert [t.num_rows for t in tables] == [1, 1, 1]  # the big one stops the first batch and goes alone
    assert table_to_records(tables[1])[0].payload == big.numpy().tobytes()
    r.close()


def test_pooled_buffers_are_reused_once_released():
    r = NativeRingTransport(1 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    r.blobs.default_bytes = 1 << 16  # so that one batch fills more than the copy-out threshold
    for _ in range(6):
        t = torch.randn(8192)  # 32 KiB: half a pooled buffer, kept zero-copy
        r.publish(key_for(t), t)
        r.sync_drain()
        table = r.take_table(10, 0.5)
        assert table.column("payload")[0].as_py() == t.numpy().tobytes()
        del table
        gc.collect()
    assert r.blobs.leases >= 6 and r.blobs.allocated <= 2
    r.close()


@pytest.mark.parametrize("fill", ["small", "large"])
def test_table_outlives_the_ring(fill):
    r = NativeRingTransport(1 << 22, "block", CPU, block_timeout=DMIConfig.block_timeout)
    r.blobs.default_bytes = 1 << 16
    t = torch.randn(16 if fill == "small" else 12000)
    r.publish(key_for(t), t)
    r.sync_drain()
    table = r.take_table(10, 0.5)
    r.close()
    del r
    gc.collect()
    assert table_to_records(table)[0].payload == t.numpy().tobytes()


def test_checksums_equal_zlib_for_every_length_and_alignment():
    import zlib

    r = NativeRingTransport(1 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    g = torch.Generator().manual_seed(7)
    sent = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in list(range(20)) + [255, 1001, 4099]]
    for t in sent:
        r.publish(key_for(t), t)
    r.sync_drain()
    table = r.take_table(1000, 1.0)
    assert table.column("checksum").to_pylist() == [zlib.crc32(t.numpy().tobytes()) for t in sent]
    r.close()


def test_large_batches_are_checksummed_on_several_threads_correctly():
    import zlib

    r = NativeRingTransport(64 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    sent = [torch.randn(2 << 20) for _ in range(5)]  # 8 MiB each: 40 MiB in one batch, 3 threads
    for t in sent:
        r.publish(key_for(t), t)
    r.sync_drain()
    table = r.take_table(1000, 1.0)
    assert table.num_rows == 5
    assert table.column("checksum").to_pylist() == [zlib.crc32(t.numpy().tobytes()) for t in sent]
    r.close()


def test_linger_waits_for_min_bytes_or_the_timeout():
    import time

    r = NativeRingTransport(4 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    small = torch.arange(64, dtype=torch.float32)  # 256 B
    r.publish(key_for(small), small)
    r.sync_drain()
    t0 = time.perf_counter()
    t = r.take_table(100, 0.3, min_bytes=1 << 20)  # not enough ready: waits out the timeout
    assert t.num_rows == 1 and time.perf_counter() - t0 >= 0.25
    big = torch.randn(1 << 18)  # 1 MiB
    for x in (small, big):
        r.publish(key_for(x), x)
    r.sync_drain()
    t0 = time.perf_counter()
    t = r.take_table(100, 5.0, min_bytes=1 << 20)  # enough ready: returns at once, both records
    assert t.num_rows == 2 and time.perf_counter() - t0 < 1.0
    r.close()


def test_drain_lingers_but_flush_is_prompt(tmp_path):
    import time

    from megatron.core.dmi.drain import Drain
    from megatron.core.dmi.key import ParallelCoords
    from megatron.core.dmi.sinks import SpoolSink

    r = NativeRingTransport(4 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    sink = SpoolSink("run", ParallelCoords(), str(tmp_path), writers=1)
    drain = Drain(r, sink, poll_seconds=2.0)  # a long linger window
    assert drain.linger_bytes == 1 << 20
    x = torch.arange(64, dtype=torch.float32)
    for i in range(5):
        r.publish(key_for(x, iteration=i + 1), x)
    t0 = time.perf_counter()
    assert drain.flush(timeout=10)
    assert time.perf_counter() - t0 < 2.5 and drain.records_persisted == 5
    drain.close()
    assert sink.close().records_written == 5
    r.close()


def test_checksums_equal_zlib_for_every_length_around_the_fast_path():
    """The C++ CRC-32 takes carry-less multiplication from 64 bytes up (64-byte and 16-byte folds,
    then a byte tail) and tables below: every length across those boundaries matches zlib."""
    r = NativeRingTransport(4 << 20, "block", CPU, block_timeout=DMIConfig.block_timeout)
    g = torch.Generator().manual_seed(3)
    lengths = list(range(0, 300)) + [1023, 1024, 1025, 4096 + 13, (1 << 20) + 7]
    sent = []
    for i, n in enumerate(lengths):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert r.publish(key_for(t, iteration=i + 1), t)
        sent.append(t)
    r.sync_drain()
    rows = []
    while r.pending():
        rows += r.take_table(1000, 1.0).select(["checksum"]).to_pylist()
    assert [row["checksum"] for row in rows] == [zlib.crc32(t.numpy().tobytes()) for t in sent]
    r.close()
