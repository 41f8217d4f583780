"""Embedded chDB store end to end. chDB allows one store per process and one process per store, so
every store is opened in a fresh process (run_isolated)."""

import glob
import os
import shutil
import socket

import pytest

from megatron.core.dmi.store.schema import SCHEMA_VERSION
from tests.unit_tests.dmi.isolated import run_isolated, run_parallel
from tests.unit_tests.dmi.sinks import workers as W


def test_roundtrip_bitwise_all_dtypes(tmp_path):
    recs = W.dtype_records()
    rep = run_isolated(W.write_embedded, str(tmp_path), recs, [W.run_info()])
    assert rep["records_written"] == len(recs) and rep["records_dropped"] == 0 and not rep["errors"]
    assert not os.listdir(tmp_path / "spool" / "rank-00000")  # the ingester consumed every segment
    payloads = run_isolated(W.read_records, str(tmp_path), [r.key for r in recs])
    assert payloads == [r.payload for r in recs]
    assert [r.key.dtype for r in recs] == ["float32", "bfloat16", "float16", "int32", "int64", "float32"]
    tensors = run_isolated(
        W.read_tensors,
        str(tmp_path),
        [dict(run_id=W.RUN, output=r.key.output, iteration=1, layer=r.key.layer) for r in recs],
    )
    for r, t in zip(recs, tensors):
        ref = r.tensor()
        assert t.dtype == ref.dtype and t.shape == ref.shape
        assert t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes() == r.payload


def test_spool_then_load_equals_direct_write(tmp_path):
    recs = W.moe_records()
    infos = [W.run_info()]
    direct, spooled, target = tmp_path / "direct", tmp_path / "spooled", tmp_path / "loaded"
    run_isolated(W.write_embedded, str(direct), recs, infos, drops=[recs[0].key])
    run_isolated(W.write_spool, str(spooled), recs, infos)
    rc, out = run_isolated(W.load_cli, ["load", str(spooled), "--store", str(target)])
    assert rc == 0, out
    assert f"{len(recs)} record(s)" in out
    a = run_isolated(W.dump_store, str(direct), ("tensors", "expert_counts", "runs", "topology"))
    b = run_isolated(W.dump_store, str(target), ("tensors", "expert_counts", "runs", "topology"))
    for t in ("tensors", "expert_counts", "runs", "topology"):
        assert a[t] == b[t], t
    assert len(a["tensors"]) == len(recs)
    # loading again is idempotent (segment ids known), and the source spool is left alone
    rc, out = run_isolated(W.load_cli, ["load", str(spooled), "--store", str(target)])
    assert rc == 0 and "0 segment(s)" in out
    assert run_isolated(W.dump_store, str(target), ("tensors",))["tensors"] == a["tensors"]


def test_two_ranks_one_reader(tmp_path):
    r0 = W.moe_records(tp=1, seed=1)
    r1 = [r for r in W.moe_records(tp=2, seed=1) if r.key.coords.rank == 1]
    flag = str(tmp_path / "rank1-closed")
    reps = run_parallel(
        [
            (W.write_embedded, (str(tmp_path), r0, [W.run_info(rank=0, world=2)], 0, True, flag)),
            (W.write_rank_then_signal, (str(tmp_path), r1, 1, flag)),
        ]
    )
    assert reps[0]["records_written"] == len(r0) and reps[1]["records_written"] == len(r1)
    assert reps[0]["segments_ingested"] >= 4
    for d in glob.glob("rank-*", root_dir=tmp_path / "spool"):  # the ingester's final pass took everything
        assert not os.listdir(tmp_path / "spool" / d), d
    dump = run_isolated(W.dump_store, str(tmp_path), ("tensors", "topology", "reports"))
    assert len(dump["tensors"]) == len(r0) + len(r1)
    assert {dict(r)["rank"] for r in dump["tensors"]} == {0, 1}
    assert sorted(dict(r)["rank"] for r in dump["topology"]) == [0, 1]
    assert sorted(dict(r)["rank"] for r in dump["reports"]) == [0, 1]
    assert dump["_ingest"]["segments_loaded"] == 0


def test_leftover_spool_read_by_reader_and_left_in_place(tmp_path):
    """A crash before the final ingest: segments stay in the spool; a reader shows them (in its
    snapshot) and leaves them for the next ingester or `load`."""
    recs = W.moe_records()
    run_isolated(W.write_spool, str(tmp_path), recs, [W.run_info()])
    before = sorted(os.listdir(tmp_path / "spool" / "rank-00000"))
    dump = run_isolated(W.dump_store, str(tmp_path), ("tensors",))
    assert len(dump["tensors"]) == len(recs)
    assert dump["_ingest"]["records"] == len(recs)
    assert sorted(os.listdir(tmp_path / "spool" / "rank-00000")) == before


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_server_unreachable_spools_and_loads_identically(tmp_path):
    recs = W.moe_records()
    infos = [W.run_info()]
    url = f"http://127.0.0.1:{_free_port()}"
    rep = run_isolated(W.write_server, str(tmp_path / "srv"), url, recs, infos)
    assert rep["records_written"] == 0
    assert rep["records_spooled"] == len(recs)
    assert rep["bytes_spooled"] == sum(len(r.payload) for r in recs)
    assert rep["records_dropped"] == 0 and rep["errors"]
    assert rep["store_lag_before_close"] == len(recs)  # all spooled, none replayed
    segs = os.listdir(tmp_path / "srv" / "spool" / "rank-00000")
    assert any(s.startswith("runs-") for s in segs) and any(s.startswith("reports-") for s in segs)
    run_isolated(W.write_embedded, str(tmp_path / "direct"), recs, infos)
    rc, out = run_isolated(W.load_cli, ["load", str(tmp_path / "srv"), "--store", str(tmp_path / "loaded")])
    assert rc == 0, out
    a = run_isolated(W.dump_store, str(tmp_path / "direct"), ("tensors", "expert_counts", "runs", "topology"))
    b = run_isolated(W.dump_store, str(tmp_path / "loaded"), ("tensors", "expert_counts", "runs", "topology"))
    for t in ("tensors", "expert_counts", "runs", "topology"):
        assert a[t] == b[t], t


def test_schema_version_mismatch(tmp_path):
    run_isolated(W.write_embedded, str(tmp_path), W.dtype_records()[:1])
    run_isolated(W.set_schema_version, str(tmp_path), SCHEMA_VERSION + 41)
    kind, msg = run_isolated(W.open_store_error, str(tmp_path))
    assert kind == "SchemaVersionError"
    assert f"schema version {SCHEMA_VERSION + 41}" in msg and f"version {SCHEMA_VERSION}" in msg


def test_corrupt_segment_reported_rest_loaded(tmp_path):
    recs = W.moe_records()
    run_isolated(W.write_spool, str(tmp_path), recs, [W.run_info()], 0, 4, 8)  # 3 tensor segments of 8
    d = tmp_path / "spool" / "rank-00000"
    tensor_segs = sorted(n for n in os.listdir(d) if n[0].isdigit())
    assert len(tensor_segs) == 3
    bad = d / tensor_segs[1]
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) - 100])  # truncated: footer gone
    rc, out = run_isolated(W.load_cli, ["load", str(tmp_path), "--store", str(tmp_path / "other")])
    assert rc == 1 and "1 corrupt" in out and tensor_segs[1] in out
    dump = run_isolated(W.dump_store, str(tmp_path / "other"), ("tensors", "segments"))
    assert len(dump["tensors"]) == len(recs) - 8
    assert [dict(r)["status"] for r in dump["segments"]].count("corrupt") == 1
    # a reader of the store itself reports the bad file and leaves it where it is
    dump = run_isolated(W.dump_store, str(tmp_path), ("tensors",))
    assert dump["_ingest"]["segments_corrupt"] == 1 and len(dump["tensors"]) == len(recs) - 8
    assert bad.exists() and not (d / (tensor_segs[1] + ".corrupt")).exists()


def test_several_readers_and_streams_load_every_record_once_in_order(tmp_path):
    """Reading threads verify segments ahead while batches are inserted on threads of their own: with three
    readers, two insert streams and batches of a few segments, every record is loaded once, the damaged segment
    is reported, and the loaded segments leave the spool."""
    recs = W.moe_records(iterations=range(1, 7))
    run_isolated(W.write_spool, str(tmp_path), recs, [W.run_info()], 0, 2, 2)  # tensor segments of 2 records
    d = tmp_path / "spool" / "rank-00000"
    tensor_segs = sorted(n for n in os.listdir(d) if n[0].isdigit())
    every_seg = [n for n in os.listdir(d) if n.endswith(".parquet")]  # the run's metadata segments too
    assert len(tensor_segs) == len(recs) // 2 >= 12
    bad = d / tensor_segs[5]
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated: footer gone
    out = run_isolated(
        W.ingest_and_count, str(tmp_path / "store"), str(tmp_path / "spool"), readers=3, streams=2, max_batch_bytes=1
    )
    r = out["result"]
    assert r["records"] == len(recs) - 2 and r["segments_corrupt"] == 1 and r["segments_loaded"] == len(every_seg) - 1
    assert sorted((t["phase"], t["iteration"], t["microbatch"], t["layer"]) for t in out["tensors"]) == sorted(
        (x.key.phase, x.key.iteration, x.key.microbatch, x.key.layer) for i, x in enumerate(recs) if i // 2 != 5
    )
    assert sorted(os.listdir(d)) == sorted(n for n in os.listdir(d) if not n[0].isdigit() or n.endswith(".corrupt"))


def test_ingest_refuses_zero_readers_or_streams():
    from megatron.core.dmi.errors import InvalidArgumentError
    from megatron.core.dmi.store.ingest import ingest_spool

    for bad in ({"readers": 0}, {"streams": 0}):
        with pytest.raises(InvalidArgumentError, match=f"{next(iter(bad))} must be >= 1"):
            ingest_spool(None, "spool", **bad)


def test_load_runs_on_the_threads_asked_for_or_the_ingesters_default(tmp_path):
    from megatron.core.dmi.store.ingester import default_ingest_threads

    recs = W.moe_records()
    run_isolated(W.write_spool, str(tmp_path / "spooled"), recs, [W.run_info()])
    spool = str(tmp_path / "spooled" / "spool")
    got = run_isolated(W.load_on_threads, str(tmp_path / "three"), spool, 3)
    assert got == {"records": len(recs), "settings": {"max_threads": 3, "max_insert_threads": 3}}
    n = default_ingest_threads()
    got = run_isolated(W.load_on_threads, str(tmp_path / "default"), spool, None)
    assert got == {"records": len(recs), "settings": {"max_threads": n, "max_insert_threads": n}}
    rc, out = run_isolated(W.load_cli, ["load", spool, "--store", str(tmp_path / "cli"), "--threads", "2"])
    assert rc == 0 and f"{len(recs)} record(s)" in out, out


def test_reingest_collapses_duplicates(tmp_path):
    """The same records in two segments with different ids (e.g. a replayed batch) collapse under FINAL."""
    recs = W.moe_records()
    run_isolated(W.write_spool, str(tmp_path / "a"), recs, [W.run_info()])
    run_isolated(W.write_spool, str(tmp_path / "b"), recs, [W.run_info()])
    shutil.copytree(tmp_path / "b" / "spool" / "rank-00000", tmp_path / "a" / "spool" / "rank-00001")
    dump = run_isolated(W.dump_store, str(tmp_path / "a"), ("tensors",))
    assert dump["_ingest"]["segments_loaded"] >= 2
    assert len(dump["tensors"]) == len(recs)


def test_store_busy_error(tmp_path):
    from megatron.core.dmi.store.backend import ChdbBackend, StoreBusyError

    run_isolated(W.write_embedded, str(tmp_path), W.dtype_records()[:1])
    import fcntl

    fd = os.open(str(tmp_path / "chdb.lock"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b"4242\n", 0)
    try:
        kind, msg = run_isolated(W.open_store_error, str(tmp_path), True)
        assert run_isolated(W.open_store_error, str(tmp_path)) == ("", "")  # a reader takes a snapshot
    finally:
        os.close(fd)
    assert kind == "StoreBusyError" and "4242" in msg
    assert ChdbBackend and StoreBusyError


def test_background_ingest_during_run(tmp_path):
    out = run_isolated(W.ingest_while_running, str(tmp_path))
    assert out["emptied"] and out["loaded_before_close"] >= 3  # runs, topology, tensors
    assert out["report"]["records_written"] == len(W.moe_records())
    dump = run_isolated(W.dump_store, str(tmp_path), ("tensors", "reports"))
    assert len(dump["tensors"]) == len(W.moe_records()) and len(dump["reports"]) == 1


def test_merge_node_local_stores(tmp_path):
    """Two nodes with node-local store dirs: export each, load both into one store, read all ranks."""
    r0 = W.moe_records(tp=1, seed=2)
    r1 = [r for r in W.moe_records(tp=2, seed=2) if r.key.coords.rank == 1]
    run_isolated(
        W.write_embedded, str(tmp_path / "node0"), r0, [W.run_info(rank=0, world=2)], 0, True, None, [r0[0].key]
    )
    run_isolated(W.write_embedded, str(tmp_path / "node1"), r1, [W.run_info(rank=1, world=2)], 1, True)
    for node in ("node0", "node1"):
        rc, out = run_isolated(W.load_cli, ["export", str(tmp_path / node), "--to", str(tmp_path / "merged_spool")])
        assert rc == 0, out
    rc, out = run_isolated(W.load_cli, ["load", str(tmp_path / "merged_spool"), "--store", str(tmp_path / "all")])
    assert rc == 0, out
    dump = run_isolated(
        W.dump_store, str(tmp_path / "all"), ("tensors", "topology", "drops", "reports", "expert_counts")
    )
    assert len(dump["tensors"]) == len(r0) + len(r1)
    assert sorted(dict(r)["rank"] for r in dump["topology"]) == [0, 1]
    assert len(dump["drops"]) == 1 and len(dump["reports"]) == 2
    direct0 = run_isolated(W.dump_store, str(tmp_path / "node0"), ("tensors",))["tensors"]
    assert set(direct0) <= set(dump["tensors"])


def test_large_insert_runs_as_parallel_streams(tmp_path):
    """A batch of several streams' worth goes in as one part per stream (the streams run side by side), and
    every row reads back bit for bit, as from the single part of one stream."""
    assert run_isolated(W.insert_in_streams, str(tmp_path / "one"), 1) == {
        "parts": 1,
        "missing": 0,
        "payloads_equal": True,
    }
    assert run_isolated(W.insert_in_streams, str(tmp_path / "four"), 4) == {
        "parts": 4,
        "missing": 0,
        "payloads_equal": True,
    }


def test_insert_streams_cut_without_copying():
    """The table is cut at row boundaries by bytes into one record batch per stream, views of the same
    payload buffer; a table under two streams' worth stays one stream with the engine's own squashing."""
    import numpy as np
    import pyarrow as pa

    from megatron.core.dmi.store.backend import MIN_STREAM_BYTES, insert_streams

    size = MIN_STREAM_BYTES // 4  # nine rows: two streams' worth, seven: one
    payload = pa.array([bytes([i]) * size for i in range(9)], type=pa.large_binary())
    table = pa.table({"k": pa.array(np.arange(9, dtype=np.int64)), "payload": payload})
    pieces, settings = insert_streams(table, 2)
    batches = pieces.to_batches()
    assert [b.num_rows for b in batches] == [4, 5] and pieces.equals(table)
    data = payload.buffers()[2]
    for b in batches:
        mine = b.column(1).buffers()[2]
        assert data.address <= mine.address and mine.address + mine.size <= data.address + data.size
    assert settings["max_threads"] == settings["max_insert_threads"] == 2
    assert settings["min_insert_block_size_rows"] == 0 and 0 < settings["min_insert_block_size_bytes"] < size * 4

    small, small_settings = insert_streams(table.slice(0, 7), 4)
    assert small.num_rows == 7 and "max_insert_threads" not in small_settings
