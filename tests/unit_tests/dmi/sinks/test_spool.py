"""Spool segments: atomic, numbered, validated; disk full drops loudly; corrupt files detected."""

import errno
import os
import re

import pyarrow as pa
import pytest

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords
from megatron.core.dmi.records import records_to_table
from megatron.core.dmi.sinks import NullSink, SpoolSink, open_sink
from megatron.core.dmi.sinks.spool import SpoolWriter
from megatron.core.dmi.store.segments import CorruptSegmentError, list_segments, read_segment
from tests.unit_tests.dmi.sinks.workers import dtype_records, moe_records, run_info
from tests.unit_tests.dmi.tables import table_to_records


def test_segment_roundtrip_bitwise_and_layout(tmp_path):
    recs = dtype_records()
    w = SpoolWriter(str(tmp_path / "spool"), 3, "run-a")
    path = w.write("tensors", records_to_table(recs))
    assert path.endswith(os.path.join("spool", "rank-00003", "00000001.parquet"))
    w.write(
        "runs",
        pa.Table.from_pylist([], schema=__import__("megatron.core.dmi.store.schema", fromlist=["x"]).RUNS_SCHEMA),
    )
    assert sorted(os.listdir(tmp_path / "spool" / "rank-00003")) == ["00000001.parquet", "runs-00000002.parquet"]
    segs = list_segments(str(tmp_path / "spool"))
    assert [(s.rank, s.kind, s.seq) for s in segs] == [(3, "tensors", 1), (3, "runs", 2)]
    back = table_to_records(read_segment(segs[0]))
    assert [(r.key, r.payload) for r in back] == [(r.key, r.payload) for r in recs]


def test_numbering_continues_and_stale_tmp_removed(tmp_path):
    d = tmp_path / "spool" / "rank-00000"
    d.mkdir(parents=True)
    (d / "00000007.parquet").write_bytes(b"x")
    (d / ".00000008.parquet.123.tmp").write_bytes(b"half")
    w = SpoolWriter(str(tmp_path / "spool"), 0)
    p = w.write("tensors", records_to_table(dtype_records()[:1]))
    assert os.path.basename(p) == "00000008.parquet"
    assert not (d / ".00000008.parquet.123.tmp").exists()


def test_disk_full_counts_dropped_with_warning(tmp_path, monkeypatch):
    sink = SpoolSink("run-a", ParallelCoords(), str(tmp_path / "spool"), writers=1)  # warnings raised inline
    sink.write_run(run_info())

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink.spool, "write", full)
    recs = dtype_records()
    with pytest.warns(RuntimeWarning, match="disk full"):
        sink.write(recs)
        sink.flush()
    with pytest.warns(RuntimeWarning):
        rep = sink.close()
    assert rep.records_dropped == len(recs)
    assert rep.bytes_dropped == sum(len(r.payload) for r in recs)
    assert rep.records_written == 0
    assert any("DROPPED" in e for e in rep.errors)
    assert not [n for n in os.listdir(tmp_path / "spool" / "rank-00000") if n.endswith(".tmp")]


def test_spool_sink_buffers_into_segments(tmp_path):
    sink = open_sink(DMIConfig(persist="spool", store_dir=str(tmp_path)), ParallelCoords(rank=1), "run-a", False)
    sink.segment_records = 10
    recs = moe_records()  # 24 records
    for i in range(0, len(recs), 4):
        sink.write(recs[i : i + 4])
    rep = sink.close()
    assert rep.records_written == len(recs) and rep.records_dropped == 0
    segs = [s for s in list_segments(str(tmp_path / "spool")) if s.kind == "tensors"]
    assert len(segs) == 2  # 24 records in writes of 4: flushes at 12 and 24
    got = [r for s in segs for r in table_to_records(read_segment(s))]
    assert [(r.key, r.payload) for r in got] == [(r.key, r.payload) for r in recs]
    assert any(s.kind == "reports" for s in list_segments(str(tmp_path / "spool")))


def test_truncated_segment_detected(tmp_path):
    w = SpoolWriter(str(tmp_path / "spool"), 0)
    p = w.write("tensors", records_to_table(dtype_records()))
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])
    with pytest.raises(CorruptSegmentError):
        read_segment(list_segments(str(tmp_path / "spool"))[0])


def test_null_sink_counts():
    s = NullSink("r", ParallelCoords())
    recs = dtype_records()
    s.write(recs)
    rep = s.close()
    assert rep.records_discarded == len(recs) and rep.records_written == 0 and rep.records_dropped == 0


def test_concurrent_write_and_metadata(tmp_path):
    """The drain thread writes while the training thread records drops and run info."""
    import threading

    sink = SpoolSink("run-a", ParallelCoords(), str(tmp_path / "spool"), segment_records=7)
    recs = moe_records(iterations=range(1, 11))
    errors = []

    def drain():
        try:
            for i in range(0, len(recs), 3):
                sink.write(recs[i : i + 3])
        except Exception as e:  # pragma: no cover
            errors.append(e)

    t = threading.Thread(target=drain)
    t.start()
    for i in range(20):
        sink.write_drops([recs[i].key], "ring full")
        if i == 5:
            sink.write_run(run_info())
        if i % 7 == 0:
            sink.flush()
    t.join()
    rep = sink.close()
    assert not errors and rep.records_written == len(recs) and rep.drops_recorded == 20
    segs = list_segments(str(tmp_path / "spool"))
    got = [r for s in segs if s.kind == "tensors" for r in table_to_records(read_segment(s))]
    assert sorted((r.key.iteration, r.key.layer, r.key.output, r.key.coords.rank) for r in got) == sorted(
        (r.key.iteration, r.key.layer, r.key.output, r.key.coords.rank) for r in recs
    )
    drops = sum(read_segment(s).num_rows for s in segs if s.kind == "drops")
    assert drops == 20


def test_runs_row_never_holds_passwords():
    import dataclasses
    import json

    from megatron.core.dmi.sinks.meta import RunInfo, runs_table

    cfg = dataclasses.asdict(DMIConfig(clickhouse_password="hunter2-secret"))
    cfg["nested"] = {"db_password": "x-secret-2", "tokenizer_type": "NullTokenizer"}
    row = runs_table(RunInfo("r", 1, None, cfg)).to_pylist()[0]
    assert "hunter2" not in row["config_json"] and "x-secret-2" not in row["config_json"]
    assert json.loads(row["config_json"])["nested"]["tokenizer_type"] == "NullTokenizer"
    assert json.loads(row["config_json"])["clickhouse_password"] == "***"


def test_parallel_writers_write_every_record_once(tmp_path):
    sink = SpoolSink("run-a", ParallelCoords(rank=2), str(tmp_path / "spool"), writers=3, segment_records=4)
    recs = moe_records()  # 24 records
    for i in range(0, len(recs), 3):
        sink.write(recs[i : i + 3])
    rep = sink.close()
    assert (rep.records_written, rep.records_dropped) == (len(recs), 0)
    assert rep.bytes_written == sum(len(r.payload) for r in recs)
    segs = [s for s in list_segments(str(tmp_path / "spool")) if s.kind == "tensors"]
    assert len(segs) == 4  # batches of 3 are never split: a segment closes at 6 rows
    back = sorted(
        (r.key.flat()["iteration"], r.key.layer, r.key.output, r.payload)
        for s in segs
        for r in table_to_records(read_segment(s))
    )
    assert back == sorted((r.key.iteration, r.key.layer, r.key.output, r.payload) for r in recs)


def test_parallel_writer_disk_full_is_counted(tmp_path, monkeypatch):
    sink = SpoolSink("run-a", ParallelCoords(), str(tmp_path / "spool"), writers=2, segment_records=4)

    def full(kind, table, durable=True):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink.spool, "write", full)
    recs = moe_records()
    with pytest.warns(RuntimeWarning):  # the report segment at close() fails too (main thread)
        for i in range(0, len(recs), 4):
            sink.write(recs[i : i + 4])
        rep = sink.close()
    assert (rep.records_written, rep.records_dropped) == (0, len(recs))
    assert sum("disk full" in e for e in rep.errors) >= 6


def test_tensor_segments_are_fsynced_at_flush(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    sink = SpoolSink("run-a", ParallelCoords(), str(tmp_path / "spool"), writers=1, segment_records=4)
    recs = moe_records()
    sink.write(recs[:4])
    sink.write(recs[4:8])  # two segments, written but not yet fsync'd
    written = [s.path for s in list_segments(str(tmp_path / "spool"))]
    assert len(written) == 2 and not set(written) & set(synced)
    sink.flush()  # what a checkpoint does
    assert set(written) <= set(synced)
    sink.close()


def test_every_sink_answers_the_whole_sink_contract(tmp_path):
    # The session reads these plainly, whatever the sink: none may leave one out.
    from megatron.core.dmi.sinks import StoreSink

    sinks = [
        NullSink("run-a", ParallelCoords()),
        SpoolSink("run-a", ParallelCoords(), str(tmp_path / "spool"), writers=1),
        StoreSink(str(tmp_path / "store"), "run-a", ParallelCoords(rank=1), is_ingester=False, writers=1),
    ]
    for sink in sinks:
        assert sink.is_ingester is False, sink.name
        report = sink.close()
        assert (report.spooled_note, report.store_complete_s) == ("", None), sink.name
    assert [s.store_lag() for s in sinks] == [None, None, (0, 0.0, 0)]


def test_store_lag_counts_what_a_store_query_cannot_see_yet(tmp_path):
    from megatron.core.dmi.sinks import StoreSink

    recs = moe_records()
    spool_only = SpoolSink("run-a", ParallelCoords(), str(tmp_path / "spool"), writers=1)
    assert spool_only.store_lag() is None  # no store at all
    spool_only.close()
    # A non-ingesting rank of the embedded store: its segments wait for the node's ingester.
    sink = StoreSink(
        str(tmp_path / "store"), "run-a", ParallelCoords(rank=1), is_ingester=False, writers=1, segment_records=10
    )
    sink.write(recs[:8])
    buffered = sum(len(r.payload) for r in recs[:8])
    assert sink.store_lag().rows == 8 and sink.store_lag().bytes >= buffered  # buffered
    sink.write(recs[8:16])
    lag = sink.store_lag()  # one segment of 16 rows written, nothing buffered
    (seg,) = [s for s in list_segments(str(tmp_path / "store" / "spool")) if s.kind == "tensors"]
    assert (lag.rows, lag.bytes) == (16, os.path.getsize(seg.path)) and lag.seconds >= 0
    os.unlink(seg.path)  # what the ingester does once a segment is loaded
    assert sink.store_lag() == (0, 0.0, 0)
    sink.close()


def test_the_log_line_asks_the_spool_once_for_rows_and_seconds(tmp_path, monkeypatch):
    # Every waiting() stats each segment in the spool, on the training thread.
    from megatron.core.dmi.session import DMISession

    monkeypatch.setenv("LOCAL_RANK", "1")  # not the node's ingester: the segment stays in the spool
    config = DMIConfig(hooks=frozenset({"attn.context"}), store_dir=str(tmp_path / "store"), transport="torch")
    session = DMISession(config)
    try:
        session.sink.write(moe_records()[:16])
        session.sink.flush()
        spool, asked = session.sink.spool, []
        real = spool.waiting
        monkeypatch.setattr(spool, "waiting", lambda: asked.append(1) or real())
        line = session.status_line()
        assert len(asked) == 1
        assert re.search(r"\| store lag: 16 records, \d+ s \|", line), line
    finally:
        session.close()
