"""The node's ingester as a process of its own (store/ingester.py): ``megatron-dmi ingest`` by hand,
the supervisor's sync/finish protocol, its status file, the report of a run whose ingester stood
down, and ``watch``'s line about it. The faults (kill -9 at each point, a dying ingester) are in
tests/fault_tests/."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from megatron.core.dmi.cli.watch import _ingester_line
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.store.ingester import STATUS_FILE, IngesterStatus, read_status
from megatron.core.dmi.validators import ConfigValueError
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.reader import live_workers as L
from tests.unit_tests.dmi.sinks import workers as W


def _ingest(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_dmi", "ingest", *args], capture_output=True, text=True, timeout=300, **kw
    )


def test_ingest_by_hand_loads_the_spool_once_and_says_so(tmp_path):
    d = str(tmp_path / "store")
    recs = W.moe_records(iterations=range(1, 3))
    run_isolated(W.write_spool, d, recs, [W.run_info()])
    first = _ingest(d)
    assert first.returncode == 0, first.stderr
    assert f"{len(recs)} record(s)" in first.stdout and "0 segment(s) left in the spool" in first.stdout
    s = read_status(d)
    assert s.state == "done" and s.owner and s.complete_at > 0 and s.waiting_segments == 0
    again = _ingest(d)  # nothing left: the store still holds each record once
    assert again.returncode == 0 and "0 record(s)" in again.stdout
    assert run_isolated(L.records_seen, d) == len(recs)


def test_ingest_refuses_a_folder_that_is_not_there(tmp_path):
    r = _ingest(str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no DMI store directory" in r.stderr


def test_ingest_checks_its_values_as_the_training_flags_do_without_torch(tmp_path):
    d = str(tmp_path / "store")
    os.makedirs(d)
    code = "import sys, megatron_dmi; rc = megatron_dmi.main(sys.argv[1:]); print('TORCH', 'torch' in sys.modules, rc)"
    ok = subprocess.run(
        [sys.executable, "-c", code, "ingest", d, "--threads", "1", "--nice", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.stdout.rstrip().endswith("TORCH False 0"), ok.stdout + ok.stderr
    for flag, bad, field in (("--nice", "20", "ingest_nice"), ("--threads", "0", "ingest_threads")):
        with pytest.raises(ConfigValueError) as refused:  # what --dmi-ingest-* says of the same value
            DMIConfig(**{field: bad})
        r = _ingest(d, flag, bad)
        assert r.returncode == 2 and f"argument {flag}: {refused.value}" in r.stderr, r.stderr


def test_the_ingesters_threads_are_chdbs_threads_or_parallel_inserts_into_a_server(tmp_path):
    """One number, ``--threads`` (``--dmi-ingest-threads``): the embedded store inserts one batch at a time on that
    many chDB threads, each insert that many streams; a server gets that many inserts at once."""
    got = run_isolated(_inserts_and_streams, str(tmp_path / "store"), 3)
    assert got == {"embedded": (1, 3), "server": 3}
    os.makedirs(tmp_path / "store", exist_ok=True)
    r = _ingest(str(tmp_path / "store"), "--clickhouse-url", "http://127.0.0.1:1", "--streams", "2")
    assert r.returncode == 2 and "unrecognized arguments: --streams 2" in r.stderr, r.stderr


def _inserts_and_streams(store_dir: str, threads: int) -> dict:
    """The batches each ingester inserts at once given ``threads``, and for the embedded store the streams of
    each insert; the server's URL is a port nobody listens on (the ingester retries it later)."""
    import socket

    from megatron.core.dmi.store.ingester import _Service

    os.makedirs(store_dir)
    svc = _Service(store_dir, "dmi", threads, None)
    try:
        embedded = (svc.streams, svc.backend.insert_streams)
    finally:
        svc.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    svc = _Service(store_dir, "dmi", threads, None, f"http://127.0.0.1:{port}")
    try:
        return {"embedded": embedded, "server": svc.streams}
    finally:
        svc.close()


def test_ingest_refuses_a_poll_interval_that_is_not_above_zero(tmp_path):
    d = str(tmp_path / "store")
    os.makedirs(d)
    for bad in ("0", "-1", "nan", "inf"):
        r = _ingest(d, "--poll-seconds", bad)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"argument --poll-seconds: expected a number of seconds above 0, got '{bad}'" in r.stderr, r.stderr
    assert _ingest(d, "--poll-seconds", "0.5").returncode == 0


def test_supervisor_sync_then_finish(tmp_path):
    """A run's supervisor: the ingester loads what was spooled before ``sync`` returns, and ``finish``
    ends the process (it closes the store: a second ingester can open it)."""
    got = run_isolated(_sync_then_finish, str(tmp_path / "store"))
    assert got["synced_records"] == got["written"] > 0
    assert got["alive_after_finish"] is False
    assert got["status_state"] == "done"
    assert run_isolated(L.records_seen, str(tmp_path / "store")) == got["written"]


def _sync_then_finish(store_dir: str) -> dict:
    from megatron.core.dmi.store.ingester import IngesterProcess

    ing = IngesterProcess(store_dir, poll_s=30.0).start()  # long poll: only sync makes it load in time
    assert ing.owner
    recs = W.moe_records(iterations=range(1, 4))
    W.write_spool(store_dir, recs, [W.run_info()])
    synced = ing.sync().records
    ing.finish()
    return {
        "written": len(recs),
        "synced_records": synced,
        "alive_after_finish": ing.alive(),
        "status_state": read_status(store_dir).state,
    }


def test_a_run_whose_ingester_stands_down_says_where_its_records_wait(tmp_path):
    """Another process holds the store (a hand-run ingester that has not loaded the run yet): the run's
    report counts nothing as written that the holder has not read back, and says where the rest waits."""
    d = str(tmp_path / "store")
    ready, stop = str(tmp_path / "ready"), str(tmp_path / "stop")
    out: dict = {}
    holder = threading.Thread(target=lambda: out.update(r=run_isolated(L.hold_reader_store, d, ready, stop)))
    holder.start()
    L._wait_for(ready)
    try:
        rep = run_isolated(W.write_embedded, d, W.moe_records(iterations=range(1, 3)), [W.run_info()])
    finally:
        open(stop, "w").close()
        holder.join(300)
    assert rep["records_written"] == 0 and rep["records_spooled"] > 0 and rep["records_dropped"] == 0
    assert "waiting in" in rep["spooled_note"] and "spool" in rep["spooled_note"]


def test_watch_says_what_the_ingester_reported(tmp_path):
    d = str(tmp_path)
    assert _ingester_line(d) == ""  # no ingester has written a status
    now = time.time()
    s = IngesterStatus(
        123,
        "node7",
        "ingesting",
        True,
        now - 60,
        passes=5,
        last_pass=now - 1,
        waiting_segments=2,
        waiting_bytes=3 << 20,
        oldest_waiting=now - 9,
    )
    with open(os.path.join(d, STATUS_FILE), "w") as f:
        f.write(s.to_json())
    line = _ingester_line(d)
    assert "pid 123 on node7" in line and "2 spool segment(s)" in line and "the oldest for 9 s" in line
