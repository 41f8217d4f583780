"""The native ring's C++ spool writer (csrc/dmi/spool_writer.h) behind Drain + spool sinks, on the
host build: what it writes reads back bitwise with its keys and checksums, segments are complete or
absent, and a failing disk is reported with the lost records counted."""

from __future__ import annotations

import os
import shutil
import time
import zlib

import pyarrow as pa
import pytest
import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.drain import Drain
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.sinks import SpoolSink
from megatron.core.dmi.store.segments import CorruptSegmentError, list_segments, read_segment, segment_rows_bytes
from megatron.core.dmi.transport.native import NativeRingTransport


def key(i: int, x: torch.Tensor, phase: str = "train") -> RecordKey:
    return RecordKey(
        "run-n",
        phase,
        1 + i // 4,
        2,
        i % 4,
        i % 2,
        i % 5,
        "attn.context",
        ParallelCoords(rank=3, tp=1),
        0,
        1,
        0,
        x.shape[0],
        x.shape[0],
        "bfloat16" if x.dtype == torch.bfloat16 else "float32",
        tuple(x.shape),
    )


def publish_many(t: NativeRingTransport, n: int, start: int = 0) -> dict:
    sent = {}
    for i in range(start, start + n):
        x = torch.randn(256 + 97 * i, 3).to(torch.bfloat16 if i % 3 == 0 else torch.float32)
        k = key(i, x)
        assert t.publish(k, x)
        sent[(k.iteration, k.microbatch, k.layer, k.invocation)] = (k, x)
    return sent


def tensor_rows(root: str) -> list[dict]:
    segs = [s for s in list_segments(root) if s.kind == "tensors"]
    return pa.concat_tables([read_segment(s) for s in segs]).to_pylist() if segs else []


def check_rows(rows: list[dict], sent: dict) -> None:
    assert len(rows) == len(sent)
    for r in rows:
        k, x = sent[(r["iteration"], r["microbatch"], r["layer"], r["invocation"])]
        payload = x.contiguous().view(torch.uint8).numpy().tobytes()
        assert r["payload"] == payload
        assert r["checksum"] == zlib.crc32(payload)
        assert (r["run_id"], r["phase"], r["attempt"], r["output"], r["dtype"]) == (
            k.run_id,
            k.phase,
            2,
            k.output,
            k.dtype,
        )
        assert tuple(r["shape"]) == k.shape and (r["rank"], r["tp"]) == (3, 1)


@pytest.fixture
def ring():
    t = NativeRingTransport(4 << 20, "block", "cpu", block_timeout=DMIConfig.block_timeout)
    yield t
    t.close()


def test_drain_uses_the_native_writer_and_everything_reads_back(tmp_path, ring):
    sink = SpoolSink("run-n", ParallelCoords(rank=3), str(tmp_path), segment_bytes=1)
    drain = Drain(ring, sink, linger_bytes=0)
    assert drain.native and ring.spooling
    with pytest.raises(RuntimeError, match="native spool writer"):
        ring.take_table(10, 0.0)
    sent = {}
    for i in range(0, 30, 10):  # three writes: a segment reaching segment_bytes is closed after each
        sent.update(publish_many(ring, 10, start=i))
        deadline = time.monotonic() + 10
        while ring.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
    drain.flush()  # after a flush every record is in a closed segment, before any close
    assert drain.records_persisted == 30
    check_rows(tensor_rows(str(tmp_path)), sent)
    raw = [s for s in list_segments(str(tmp_path)) if s.raw]
    assert len(raw) >= 3, "segments rotate at segment_bytes"
    assert sum(segment_rows_bytes(s)[0] for s in raw) == 30
    assert sink.store_lag() is None and sink.spool.waiting().rows == 30
    sent.update(publish_many(ring, 5, start=30))
    drain.close()
    report = sink.close()
    assert (report.records_written, report.records_dropped, report.errors) == (35, 0, [])
    assert report.bytes_written == sum(x.numel() * x.element_size() for _, x in sent.values())
    check_rows(tensor_rows(str(tmp_path)), sent)


def test_large_records_are_checksummed_in_pieces_like_zlib(tmp_path):
    """Records above the writer's 4 MiB checksum piece (and a batch large enough for several
    threads) carry the CRC zlib gives the whole payload."""
    t = NativeRingTransport(64 << 20, "block", "cpu", block_timeout=DMIConfig.block_timeout)
    sink = SpoolSink("run-n", ParallelCoords(rank=3), str(tmp_path))
    drain = Drain(t, sink)
    assert drain.native
    sent = {}
    for i, rows in enumerate((4 << 20 >> 2, (9 << 20) // 12 + 5, 1, 0, (17 << 20) // 12)):  # 4 MiB, 9 MiB+, ..., 17 MiB
        x = torch.randn(rows, 3)
        k = key(i, x)
        assert t.publish(k, x)
        sent[(k.iteration, k.microbatch, k.layer, k.invocation)] = (k, x)
    drain.flush()
    busy = t.spool_stats()  # where the writer's time went, for telling whether it keeps pace
    assert busy["checksum_ns"] > 0 and busy["write_ns"] > 0 and busy["sync_ns"] > 0
    drain.close()
    t.close()
    assert sink.close().records_written == len(sent)
    check_rows(tensor_rows(str(tmp_path)), sent)


def test_python_consumer_still_available(tmp_path, ring):
    sink = SpoolSink("run-n", ParallelCoords(rank=3), str(tmp_path))
    drain = Drain(ring, sink, native_spool=False)
    assert not drain.native and not ring.spooling
    sent = publish_many(ring, 6)
    drain.close()
    assert sink.close().records_written == 6
    assert not any(s.raw for s in list_segments(str(tmp_path)))
    check_rows(tensor_rows(str(tmp_path)), sent)


def test_unflushed_segment_is_a_temporary_file_until_complete(tmp_path, ring):
    sink = SpoolSink("run-n", ParallelCoords(rank=3), str(tmp_path), segment_bytes=1 << 30, segment_seconds=3600)
    drain = Drain(ring, sink, linger_bytes=0)
    publish_many(ring, 4)
    deadline = time.monotonic() + 10
    while ring.spool_stats()["records"] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring.spool_stats()["open_rows"] == 4
    assert drain.records_persisted == 4 and sink._unwritten()[0] == 4  # live, not as of the last relay
    names = os.listdir(sink.spool.dir)
    assert not [n for n in names if n.endswith(".dmiraw")], "an open segment has no final name"
    assert [n for n in names if n.endswith(".tmp")], names
    drain.close()
    sink.close()
    assert [s.raw for s in list_segments(str(tmp_path)) if s.kind == "tensors"] == [True]


def test_write_failure_is_reported_and_counted(tmp_path, ring):
    sink = SpoolSink("run-n", ParallelCoords(rank=3), str(tmp_path))
    drain = Drain(ring, sink)
    shutil.rmtree(sink.spool.dir)  # the disk goes away under the writer
    publish_many(ring, 3)
    with pytest.warns(RuntimeWarning) as said:  # said when it happens
        drain.close()
    assert any("those rows are DROPPED" in str(w.message) for w in said), [str(w.message) for w in said]
    os.makedirs(sink.spool.dir)  # so the sink can write its report
    report = sink.close()
    assert report.records_written == 0 and report.records_dropped == 3
    assert any("cannot create spool segment" in e for e in report.errors), report.errors


def test_truncated_raw_segment_is_corrupt(tmp_path, ring):
    sink = SpoolSink("run-n", ParallelCoords(rank=3), str(tmp_path))
    drain = Drain(ring, sink)
    publish_many(ring, 3)
    drain.close()
    sink.close()
    (seg,) = [s for s in list_segments(str(tmp_path)) if s.raw]
    size = os.path.getsize(seg.path)
    with open(seg.path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CorruptSegmentError, match="damaged raw segment"):
        read_segment(seg)
    with open(seg.path, "r+b") as f:
        f.write(b"NOTDMI!!")
    with pytest.raises(CorruptSegmentError, match="bad magic"):
        read_segment(seg)


def test_segment_closes_by_age_without_a_flush(tmp_path, ring):
    """A live reader sees a step's records once the segment is old enough, with no flush and no
    further record (here 0.2 s; 2 s by default)."""
    sink = SpoolSink("run-n", ParallelCoords(rank=3), str(tmp_path), segment_bytes=1 << 30, segment_seconds=0.2)
    drain = Drain(ring, sink, linger_bytes=0)
    sent = publish_many(ring, 4)
    deadline = time.monotonic() + 60
    while not list_segments(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    segs = [s for s in list_segments(str(tmp_path)) if s.kind == "tensors"]
    assert [s.raw for s in segs] == [True], "the open segment was closed by age"
    check_rows(tensor_rows(str(tmp_path)), sent)
    drain.close()
    sink.close()
