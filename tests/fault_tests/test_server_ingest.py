"""The server path (issue 33 item 5): with ``--dmi-clickhouse-url`` the ranks spool and the node's ingester inserts
the spool into the server with several streams, reading every insert back. Faults against a real local server
(``chdb_server.py``: ClickHouse's HTTP interface in front of the ClickHouse engine), each ending with every record
in the server exactly once (FINAL, as every reader reads) and the report's ``written`` equal to what the server
holds:

1. the server down when the ingester starts: the segments wait in the spool, the ingester retries with back-off;
2. the server dying mid-run (SIGKILL while it receives an insert, or after storing one before answering), then
   back on the same port and store; or refusing connections for a while;
3. an insert the server answers 500 (before or after storing it), or acknowledges and partly loses: the
   read-back catches it and the segment is retried;
4. ``kill -9`` of the ingester at each point of a pass into the server, then a restart;
5. a second ingester on the same spool stands down.

Counts are plain SQL on the server (ingester_workers.count_per_key).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from megatron.core.dmi.store.ingest import TEST_CRASH_ENV, TEST_CRASH_POINTS
from megatron.core.dmi.store.ingester import EXIT_STANDING_DOWN, SPOOL_LOCK, read_status
from megatron.core.dmi.store.segments import list_segments
from tests.fault_tests import ingester_workers as IW
from tests.fault_tests.chdb_server import ChdbServer
from tests.fault_tests.test_ingester_process import AFTER_THE_KILL, assert_every_record_once, ingest_cli
from tests.functional_tests.launch import REPO
from tests.unit_tests.dmi.isolated import run_isolated

PER_SEGMENT = 4  # records per spool segment
THREADS = 2  # the ingester's parallel inserts into the server


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def records(iterations) -> list:
    return IW.records(0, iterations, tokens=256)  # 64 KiB router.logits and a router.expert_counts per layer


def verified(ing) -> int:
    """Records of the run (rank 0, attempt 1) the ingester has read back from the server so far."""
    return ing.result.verified.get((IW.RUN, 1, 0), [0])[0]


def spool_left(store: str) -> list:
    return list_segments(os.path.join(store, "spool"))


def assert_exact(store: str, url: str, recs: list, rep: dict) -> None:
    """Every record in the server once, the spool empty, and the report's counts what the server holds."""
    got = assert_every_record_once(url, IW.keys_of(recs))
    assert rep["records_written"] == sum(got["tensors"].values()) == len(recs), rep
    assert rep["records_spooled"] == 0 and rep["records_dropped"] == 0 and not rep["spooled_note"], rep
    assert not spool_left(store)


# -- 1. the server down at start -----------------------------------------------------------------------------------


def test_a_server_down_at_start_is_retried_and_then_takes_every_record_once(tmp_path):
    store = str(tmp_path / "store")
    server = ChdbServer(str(tmp_path / "server"), free_port())  # not started: its port refuses connections
    recs = records(range(1, 7))
    half = len(recs) // 2
    try:
        sink = IW._sink(store, PER_SEGMENT, url=server.url, threads=THREADS)
        ing = sink.ingester
        sink.write(recs[:half])
        sink.flush()
        IW.wait_until(
            lambda: any("cannot connect to ClickHouse" in e for e in ing.result.errors),
            "the ingester to find no server",
        )
        IW.wait_until(lambda: ing.status.waiting_segments >= half // PER_SEGMENT, "the segments to wait in the spool")
        assert verified(ing) == 0
        server.start()
        # the ingester's next try (5 s after the first) finds the server: no sync needed to load the first half
        IW.wait_until(lambda: verified(ing) >= half, "the ingester to load the first half once the server is up")
        sink.write(recs[half:])
        rep = dataclasses.asdict(sink.close())
        assert any("cannot connect to ClickHouse" in e and "are retried" in e for e in rep["errors"]), rep["errors"]
        assert_exact(store, server.url, recs, rep)
    finally:
        server.kill()


# -- 2. the server dying, or refusing connections, mid-run ------------------------------------------------------


def refused(port: int) -> bool:
    """Whether a connection to the port is refused now."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True
    except OSError:  # e.g. reset: the listening socket closed while this connection waited in its backlog
        return False


@pytest.mark.parametrize("fault", ["die_mid_body", "die_after_store", "refuse_connections"])
def test_a_server_dying_or_refusing_mid_run_loses_and_duplicates_nothing(fault, tmp_path):
    """die_*: the server is SIGKILLed while it receives an insert of tensor records, or after storing one before
    answering, and comes back on the same port and store; refuse_connections: it closes its listening socket for
    a while (connections refused), then listens again. Training goes on spooling meanwhile."""
    store = str(tmp_path / "store")
    recs = records(range(1, 10))
    third = len(recs) // 3
    with ChdbServer(str(tmp_path / "server")) as server:
        sink = IW._sink(store, PER_SEGMENT, url=server.url, threads=THREADS)
        ing = sink.ingester
        sink.write(recs[:third])
        sink.flush()
        IW.wait_until(lambda: verified(ing) >= third, "the first third in the server")
        if fault == "refuse_connections":
            server.fault(refuse_s=8)
            IW.wait_until(lambda: refused(server.port), "the server to refuse connections")
        else:
            server.fault(insert=fault)  # the next insert of tensor records kills the server (SIGKILL)
        sink.write(recs[third : 2 * third])
        sink.flush()
        if fault != "refuse_connections":
            assert server.proc.wait(timeout=IW.WAIT_S) == -signal.SIGKILL
        IW.wait_until(lambda: ing.status.result.get("errors"), "the ingester to notice")
        sink.write(recs[2 * third :])  # training goes on spooling
        sink.flush()
        assert verified(ing) < len(recs)
        if fault == "refuse_connections":
            IW.wait_until(lambda: not refused(server.port), "the server to listen again")
        else:
            server.start()  # back on the same port and store
        rep = dataclasses.asdict(sink.close())
        assert any("ClickHouse at 127.0.0.1" in e for e in rep["errors"]), rep["errors"]
        assert_exact(store, server.url, recs, rep)


# -- 3. inserts refused or partly lost --------------------------------------------------------------------------------

# What the ingester says about each fault, in the report's errors
SAYS = {
    "drop_row": "row(s) not found in the store after the insert; the segment stays in the spool and is retried",
    "fail_500": "test fault: the insert into tensors failed; nothing was stored",
    "store_then_500": "of the rows are in the store nevertheless (read back); they stay in the spool",
}


@pytest.mark.parametrize("fault", sorted(SAYS))
def test_an_insert_refused_or_acknowledged_and_lost_is_caught_by_the_read_back(fault, tmp_path):
    store = str(tmp_path / "store")
    recs = records(range(1, 7))
    with ChdbServer(str(tmp_path / "server")) as server:
        server.fault(insert=fault, times=2)
        sink = IW._sink(store, PER_SEGMENT, url=server.url, threads=THREADS)
        for r in recs:
            sink.write([r])
        rep = dataclasses.asdict(sink.close())
        assert server.stats()["faults_fired"] == [f"{fault}:tensors"] * 2
        assert any(SAYS[fault] in e for e in rep["errors"]), rep["errors"]
        assert_exact(store, server.url, recs, rep)


# -- 4. kill -9 of the ingester at each point of a pass, then a restart -------------------------------------------


@pytest.fixture(scope="module")
def server_loaded_then_more(tmp_path_factory):
    """A server's store that holds a first part of a run (loaded by one pass of an ingester), and a spool holding
    a second part: rank 0's native ``.dmiraw`` segments and rank 1's Parquet ones. Tests copy both."""
    root = tmp_path_factory.mktemp("template")
    store = str(root / "store")
    first = [IW.records(0, range(1, 3)), IW.records(1, range(1, 3))]
    second = [IW.records(0, range(3, 7)), IW.records(1, range(3, 7))]
    assert run_isolated(IW.spool_native, store, first[0], PER_SEGMENT) == len(first[0])
    assert run_isolated(IW.spool_parquet, store, first[1], 1, PER_SEGMENT) == len(first[1])
    with ChdbServer(str(root / "server")) as server:
        rc, out = ingest_cli(store, "--clickhouse-url", server.url)
    assert rc == 0 and f"{len(first[0]) + len(first[1])} record(s)" in out, out
    assert run_isolated(IW.spool_native, store, second[0], PER_SEGMENT) == len(second[0])
    assert run_isolated(IW.spool_parquet, store, second[1], 1, PER_SEGMENT) == len(second[1])
    waiting = [s for s in spool_left(store) if s.kind == "tensors"]
    assert len(waiting) == 2 * len(second[0]) // PER_SEGMENT and {s.raw for s in waiting} == {True, False}
    return root, IW.keys_of(first[0] + first[1]), IW.keys_of(second[0] + second[1]), len(waiting)


@pytest.mark.parametrize("restart", ["cli", "supervisor"])
@pytest.mark.parametrize("point", TEST_CRASH_POINTS)
def test_an_ingester_killed_at_any_point_of_a_pass_into_a_server_loses_and_duplicates_nothing(
    point, restart, server_loaded_then_more, tmp_path
):
    template, loaded, batch, segments = server_loaded_then_more
    shutil.copytree(template, tmp_path / "case", symlinks=True)
    store = str(tmp_path / "case" / "store")
    with ChdbServer(str(tmp_path / "case" / "server")) as server:
        # one insert at a time: the kill lands on a known batch (all tensor segments of the pass, under 256 MiB)
        rc, out = ingest_cli(
            store, "--clickhouse-url", server.url, "--threads", "1", env={TEST_CRASH_ENV: f"{point}:tensors"}
        )
        assert rc == -signal.SIGKILL, out
        assert "ingested" not in out, out  # it died before its summary

        inserted, derived, recorded, deleted = AFTER_THE_KILL[point]
        left = [s for s in spool_left(store) if s.kind == "tensors"]
        assert len(left) == segments - deleted
        got = run_isolated(IW.count_per_key, server.url)
        assert set(loaded) <= set(got["tensors"])  # the first part, loaded before
        if inserted is not None:
            assert (set(batch) & set(got["tensors"])) == (set(batch) if inserted else set())
            counts = {k for k in batch if k[0] == "router.expert_counts"}
            assert (counts & set(got["expert_counts"])) == (counts if derived else set())
        assert got["tensor_segments_recorded"] == segments // 2 + (segments if recorded else 0)

        if restart == "cli":
            rc, out = ingest_cli(store, "--clickhouse-url", server.url)
            assert rc == 0 and "0 segment(s) left in the spool" in out and "  ! " not in out, out
        else:
            done = run_isolated(IW.supervised_pass, store, server.url)
            assert done["owner"] and not done["result"]["errors"], done
        assert_every_record_once(server.url, loaded + batch)
        assert not spool_left(store)


# -- 5. one ingester per spool ---------------------------------------------------------------------------------------


def test_a_second_ingester_of_a_server_stores_spool_stands_down_naming_the_holder(tmp_path):
    """The spool's ``ingester.lock``: a second ingester on the same spool (another node on a shared store folder,
    a hand-run one) stands down, as for the embedded store's lock, and says who holds it."""
    store = str(tmp_path / "store")
    os.makedirs(os.path.join(store, "spool"))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the holder waits for it, holding the lock
    holder = subprocess.Popen(
        [sys.executable, "-m", "megatron_dmi", "ingest", store, "--clickhouse-url", url, "--follow"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        IW.wait_until(lambda: getattr(read_status(store), "pid", None) == holder.pid, "the holder's first status")
        rc, out = ingest_cli(store, "--clickhouse-url", url)
        assert rc == EXIT_STANDING_DOWN and "not ingesting: another process holds the store" in out, out
        with open(os.path.join(store, SPOOL_LOCK)) as f:
            assert f.read().strip() == str(holder.pid)
    finally:
        holder.terminate()
        holder.wait(timeout=IW.WAIT_S)
