"""The spool bound (``--dmi-spool-max-gb``): when the store's ingest cannot keep up and the bytes
waiting in a rank's spool reach the bound, the drain stops taking records, DMI warns once per
spell, and the ring's ``--dmi-on-full`` policy decides: ``drop`` drops exactly what the ring cannot
hold (counted, keys stored), ``block`` makes the producer wait until segments are ingested. Flushes
and close still write everything captured. Real transports (the pure-PyTorch ring through the
Python drain, the native host ring through its C++ spool writer) and a real embedded-store sink
whose rank is not the ingester, so nothing takes its segments unless the test does."""

from __future__ import annotations

import logging
import os
import threading
import time

import pyarrow as pa
import pytest
import torch

from megatron.core.dmi.config import DMIConfig, SpoolBoundError
from megatron.core.dmi.drain import Drain
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.sinks import StoreSink, open_sink
from megatron.core.dmi.store.segments import list_segments, read_segment
from megatron.core.dmi.transport.native import NativeRingTransport
from megatron.core.dmi.transport.torch_ring import TorchRingTransport

RANK = 1
ROWS = 16384  # float32: 64 KiB per record
RING_BYTES = 4 * ROWS * 4  # four records
BOUND = "--dmi-spool-max-gb bound"
WAIT = 30.0  # seconds a test waits for something that must happen before it fails


def key(i: int) -> RecordKey:
    return RecordKey(
        "run-b", "train", 1 + i // 8, 1, i % 8, 0, i, "attn.context", ParallelCoords(rank=RANK), 0, 1, 0, ROWS, ROWS,
        "float32", (ROWS,),
    )  # fmt: skip


def ident(row_or_key) -> tuple[int, int, int]:
    get = row_or_key.get if isinstance(row_or_key, dict) else lambda name: getattr(row_or_key, name)
    return get("iteration"), get("microbatch"), get("layer")


def open_transport(kind: str, on_full: str, block_timeout: float = DMIConfig.block_timeout):
    if kind == "torch":
        return TorchRingTransport(RING_BYTES, on_full, torch.device("cpu"), block_timeout=block_timeout)
    return NativeRingTransport(RING_BYTES, on_full, "cpu", block_timeout=block_timeout)


def bounded_sink(tmp_path, max_bytes: int = 1) -> StoreSink:
    """A rank's sink whose every batch becomes a segment, and no ingester: its spool only grows."""
    return StoreSink(
        str(tmp_path / "store"),
        "run-b",
        ParallelCoords(rank=RANK),
        is_ingester=False,
        writers=1,
        segment_bytes=1,
        spool_max_bytes=max_bytes,
    )


def spool_root(tmp_path) -> str:
    return str(tmp_path / "store" / "spool")


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def bound_warnings(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning) and BOUND in str(w.message)]


def publish(transport, i: int) -> bool:
    return transport.publish(key(i), torch.full((ROWS,), float(i)))


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_at_the_bound_drop_drops_and_counts_exactly_what_did_not_fit(tmp_path, kind, recwarn):
    transport = open_transport(kind, "drop")
    sink = bounded_sink(tmp_path)
    drain = Drain(transport, sink, linger_bytes=0)
    assert drain.native == (kind == "native")
    assert publish(transport, 0)
    wait_until(lambda: drain.holding, "the first segment to reach the bound")
    accepted, dropped = [0], []
    for i in range(1, 41):  # ten times what the ring holds
        (accepted if publish(transport, i) else dropped).append(i)
    assert dropped, "nothing takes from the ring at the bound, so it fills"
    assert transport.stats.dropped == len(dropped) and len(accepted) + len(dropped) == 41
    assert drain.flush(WAIT)  # a checkpoint's flush writes what the ring holds, past the bound
    assert drain.records_persisted == len(accepted)
    drain.close()
    sink.write_drops([key(i) for i in dropped], reason="ring full (--dmi-on-full drop)")
    report = sink.close()
    transport.close()

    segments = list_segments(spool_root(tmp_path), ranks={RANK})
    written = [r for s in segments if s.kind == "tensors" for r in read_segment(s).to_pylist()]
    drops = pa.concat_tables([read_segment(s) for s in segments if s.kind == "drops"]).to_pylist()
    assert sorted(map(ident, written)) == sorted(ident(key(i)) for i in accepted)
    assert sorted(map(ident, drops)) == sorted(ident(key(i)) for i in dropped)
    for r in written:  # every kept record is the tensor published under its key
        assert r["payload"] == torch.full((ROWS,), float(r["layer"])).numpy().tobytes()
    assert (report.records_written, report.records_dropped, report.drops_recorded) == (len(accepted), 0, len(dropped))
    warned = bound_warnings(recwarn)
    assert len(warned) == 1 and drain.bound_spells == 1, warned
    assert f"rank-{RANK:05d}" in warned[0] and "--dmi-on-full drop" in warned[0] and "dropped" in warned[0]
    assert drain.bound_seconds > 0


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_at_the_bound_block_waits_and_resumes_as_segments_are_ingested(tmp_path, kind, recwarn, caplog):
    caplog.set_level(logging.WARNING, logger="megatron.core.dmi.drain")
    transport = open_transport(kind, "block", block_timeout=WAIT)
    sink = bounded_sink(tmp_path)
    drain = Drain(transport, sink, linger_bytes=0)
    total = 24
    published = [publish(transport, 0)]
    wait_until(lambda: drain.holding, "the first segment to reach the bound")
    done = threading.Event()

    def produce():
        for i in range(1, total):
            published.append(publish(transport, i))
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    # The ring fills and the producer waits: 23 records do not fit a ring of four (plus the native
    # ring's staging of four) while nothing is taken.
    wait_until(lambda: transport.pending() >= 4, "the ring to fill")
    assert not done.is_set()
    assert "capture now waits" in bound_warnings(recwarn)[0] and "--dmi-on-full block" in bound_warnings(recwarn)[0]

    ingested = []  # what the test, standing in for the node's ingester, took out of the spool

    def ingest():
        for seg in list_segments(spool_root(tmp_path), ranks={RANK}):
            if seg.kind == "tensors":
                ingested.extend(map(ident, read_segment(seg).to_pylist()))
                os.unlink(seg.path)

    while not done.wait(0.05):
        ingest()
    producer.join()
    drain.close()
    report = sink.close()
    transport.close()
    ingest()

    assert all(published) and transport.stats.dropped == 0
    assert sorted(ingested) == sorted(ident(key(i)) for i in range(total))
    assert report.records_written == total and report.records_dropped == 0
    assert len(bound_warnings(recwarn)) == drain.bound_spells >= 1  # once per spell
    assert "capture resumes after" in caplog.text and "below the --dmi-spool-max-gb bound again" in caplog.text


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_close_at_the_bound_writes_everything_the_ring_holds(tmp_path, kind):
    transport = open_transport(kind, "block", block_timeout=WAIT)
    sink = bounded_sink(tmp_path)
    drain = Drain(transport, sink, linger_bytes=0)
    with pytest.warns(RuntimeWarning, match=BOUND):
        assert publish(transport, 0)
        wait_until(lambda: drain.holding, "the first segment to reach the bound")
    for i in range(1, 4):  # what the ring holds, so block mode never waits here
        assert publish(transport, i)
    drain.close()  # held, with records in the ring: close still writes them (past the bound)
    report = sink.close()
    transport.close()
    assert report.records_written == 4 and transport.stats.dropped == 0


def test_the_spool_backlog_counts_segments_until_they_are_ingested(tmp_path):
    sink = bounded_sink(tmp_path, max_bytes=1 << 30)
    assert sink.spool_backlog().waiting_bytes == 0 and not sink.spool_backlog().full
    transport = open_transport("torch", "block")
    for i in range(3):
        publish(transport, i)
    sink.write_table(transport.take_table(10, 1.0))  # one segment
    seg = next(s for s in list_segments(spool_root(tmp_path)) if s.kind == "tensors")
    backlog = sink.spool_backlog()
    assert backlog.waiting_bytes == os.path.getsize(seg.path) > 3 * ROWS * 4
    assert backlog.folder == os.path.dirname(seg.path)
    os.unlink(seg.path)  # what the ingester does once it loaded the segment
    assert sink.spool_backlog().waiting_bytes == 0
    sink.close()
    unbounded = StoreSink(str(tmp_path / "other"), "run-b", ParallelCoords(rank=RANK), is_ingester=False)
    assert unbounded.spool_backlog() is None
    unbounded.close()


def test_the_bound_is_a_flag_of_stores_only(tmp_path):
    config = DMIConfig(store_dir=str(tmp_path), spool_max_gb=0.5)
    sink = open_sink(config, ParallelCoords(rank=RANK), "run-b", is_ingester=False)
    assert sink.spool_max_bytes == 1 << 29
    sink.close()
    for persist in ("spool", "none"):
        with pytest.raises(SpoolBoundError, match=f"--dmi-persist {persist} has none"):
            DMIConfig(persist=persist, spool_max_gb=1.0)
    for bad in ("0", "-1", "nan", "lots"):
        with pytest.raises(ValueError, match="GiB"):
            DMIConfig(spool_max_gb=bad)


def test_the_log_line_and_the_report_say_how_long_capture_was_at_the_bound(tmp_path, monkeypatch):
    from megatron.core.dmi.session import DMISession

    monkeypatch.setenv("LOCAL_RANK", "1")  # not the node's ingester: nothing takes the spool away
    config = DMIConfig(
        hooks=frozenset({"attn.context"}),
        store_dir=str(tmp_path / "store"),
        transport="torch",
        ring_mb=RING_BYTES / 2**20,
        on_full="drop",
        spool_max_gb=1e-9,  # one byte
    )
    session = DMISession(config)
    try:
        assert "at the spool bound" not in session.status_line()
        with pytest.warns(RuntimeWarning, match=BOUND):
            assert session.transport.publish(key(0), torch.zeros(ROWS))
            wait_until(lambda: session.drain.holding, "the first segment to reach the bound")
        assert " s at the spool bound (1x) |" in session.status_line()
    finally:
        report = session.close()
    assert " s at the --dmi-spool-max-gb bound (1 time(s)): the store's ingest fell behind capture" in report.text
