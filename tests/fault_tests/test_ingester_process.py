"""Faults of the node's ingester process (issue 33 item 4), on the CPU with real chDB and the real
``megatron-dmi ingest`` process:

1. ``kill -9`` of the ingester at each point of loading a batch (``$DMI_TEST_CRASH_AT``, store/ingest.py),
   then a restart: every record is in the store exactly once;
2. the ingester killed during a run: the sink goes on spooling, the supervisor restarts it, and the report
   matches the store;
3. the training process killed: its ingester makes a final pass and exits by itself;
4. ``load`` into a store a live ingester holds: one useful line, no lock error;
5. a run on a store another ingester holds: its own ingester stands down, the holder loads the run.

Counts are plain SQL per key on the store (ingester_workers.count_per_key), in a process of its own.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from megatron.core.dmi.store.ingest import TEST_CRASH_ENV, TEST_CRASH_POINTS
from megatron.core.dmi.store.ingester import MAX_RESTARTS, read_status
from megatron.core.dmi.store.segments import list_segments
from tests.fault_tests import ingester_workers as IW
from tests.functional_tests.launch import REPO
from tests.unit_tests.dmi.isolated import run_isolated

HERE = os.path.dirname(os.path.abspath(__file__))
PER_SEGMENT = 4  # records per spool segment


def ingest_cli(store, *args, env=None, timeout=IW.WAIT_S):
    """``megatron-dmi ingest STORE ARGS`` to its end; returns (exit status, output)."""
    e = dict(os.environ, **(env or {}))
    p = subprocess.run(
        [sys.executable, "-m", "megatron_dmi", "ingest", store, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=e,
        timeout=timeout,
    )
    return p.returncode, p.stdout + p.stderr


def cli(*args):
    p = subprocess.run(
        [sys.executable, "-m", "megatron_dmi", *args], capture_output=True, text=True, cwd=REPO, timeout=IW.WAIT_S
    )
    return p.returncode, p.stdout, p.stderr


def gone(pid: int) -> bool:
    """The process ended (an orphan that nobody reaps yet counts as ended: a zombie runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_every_record_once(store, keys):
    """The store holds each key once (FINAL, as every reader reads), nothing else, and nothing twice otherwise."""
    got = run_isolated(IW.count_per_key, store)
    want = collections.Counter(keys)
    assert max(want.values()) == 1
    assert got["tensors"] == dict(want), {k: v for k, v in got["tensors"].items() if want.get(k) != v}
    counts = {k: v for k, v in want.items() if k[0] == "router.expert_counts"}
    assert got["expert_counts"] == {k: (64, 64) for k in counts}  # one row per expert, each expert once
    assert got["differing_copies"] == 0 and got["segments_twice"] == 0, got
    return got


# -- 1. kill -9 at each point of a pass, then a restart ------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded_then_more(tmp_path_factory):
    """A store that holds a first part of a run (loaded by one pass), and a spool holding a second part: rank 0's
    native ``.dmiraw`` segments and rank 1's Parquet ones, several of each. Tests copy it."""
    store = str(tmp_path_factory.mktemp("template") / "store")
    first = [IW.records(0, range(1, 3)), IW.records(1, range(1, 3))]
    second = [IW.records(0, range(3, 7)), IW.records(1, range(3, 7))]
    assert run_isolated(IW.spool_native, store, first[0], PER_SEGMENT) == len(first[0])
    assert run_isolated(IW.spool_parquet, store, first[1], 1, PER_SEGMENT) == len(first[1])
    rc, out = ingest_cli(store)
    assert rc == 0 and f"{len(first[0]) + len(first[1])} record(s)" in out, out
    assert run_isolated(IW.spool_native, store, second[0], PER_SEGMENT) == len(second[0])
    assert run_isolated(IW.spool_parquet, store, second[1], 1, PER_SEGMENT) == len(second[1])
    waiting = [s for s in list_segments(os.path.join(store, "spool")) if s.kind == "tensors"]
    assert len(waiting) == 2 * len(second[0]) // PER_SEGMENT and {s.raw for s in waiting} == {True, False}
    return store, IW.keys_of(first[0] + first[1]), IW.keys_of(second[0] + second[1]), len(waiting)


# What the store holds right after the kill at each point, of the batch of tensor segments the pass loads:
# (its records in dmi.tensors, their derived rows in dmi.expert_counts, its segments recorded in dmi.segments,
# its segments deleted); None: depends on when the kill landed.
AFTER_THE_KILL = {
    "during_insert": (None, None, False, 0),
    "mid_insert": (True, False, False, 0),
    "after_insert": (True, True, False, 0),
    "after_read_back": (True, True, False, 0),
    "after_record": (True, True, True, 0),
    "mid_retire": (True, True, True, 1),
}


@pytest.mark.parametrize("restart", ["cli", "supervisor"])
@pytest.mark.parametrize("point", TEST_CRASH_POINTS)
def test_an_ingester_killed_at_any_point_of_a_pass_loses_and_duplicates_nothing(
    point, restart, loaded_then_more, tmp_path
):
    template, loaded, batch, segments = loaded_then_more
    store = str(tmp_path / "store")
    shutil.copytree(template, store, symlinks=True)  # chDB links its tables relatively
    rc, out = ingest_cli(store, env={TEST_CRASH_ENV: f"{point}:tensors"})
    assert rc == -signal.SIGKILL, out
    assert "ingested" not in out, out  # it died before its summary

    inserted, derived, recorded, deleted = AFTER_THE_KILL[point]
    left = [s for s in list_segments(os.path.join(store, "spool")) if s.kind == "tensors"]
    assert len(left) == segments - deleted
    got = run_isolated(IW.count_per_key, store)
    assert {k for k in loaded} <= set(got["tensors"])  # the first part, loaded before
    if inserted is not None:
        assert (set(batch) & set(got["tensors"])) == (set(batch) if inserted else set())
        counts = {k for k in batch if k[0] == "router.expert_counts"}
        assert (counts & set(got["expert_counts"])) == (counts if derived else set())
    assert got["tensor_segments_recorded"] == segments // 2 + (segments if recorded else 0)

    if restart == "cli":
        rc, out = ingest_cli(store)
        assert rc == 0 and "0 segment(s) left in the spool" in out and "  ! " not in out, out
    else:
        got = run_isolated(IW.supervised_pass, store)
        assert got["owner"] and not got["result"]["errors"], got
    assert not list_segments(os.path.join(store, "spool"))
    assert_every_record_once(store, loaded + batch)


# -- 2. the ingester killed during a run ---------------------------------------------------------------------------


@pytest.mark.parametrize("crash_at", ["", "after_read_back:tensors"], ids=["kill-by-pid", "after-read-back"])
def test_an_ingester_killed_mid_run_is_restarted_and_the_report_matches_the_store(crash_at, tmp_path):
    store = str(tmp_path / "store")
    recs = IW.records(0, range(1, 13), tokens=256)
    got = run_isolated(IW.ingester_killed_mid_run, store, recs, PER_SEGMENT, crash_at, timeout=IW.WAIT_S)
    assert got["restarted_pid"] != got["killed"], got
    assert got["restarts"] == 1
    assert any(
        f"the ingester process (pid {got['killed']}) died (exit status -9); training goes on spooling; restarting"
        in line
        for line in got["log"]
    ), got["log"]
    rep = got["report"]
    assert any("died (exit status -9) during the run and was restarted" in e for e in rep["errors"]), rep
    assert gone(got["restarted_pid"])  # finished at close
    assert_report_is_the_store(rep, store, recs)


def test_an_ingester_that_keeps_dying_is_left_dead_and_a_pass_at_close_loads_everything(tmp_path):
    store = str(tmp_path / "store")
    recs = IW.records(0, range(1, 13), tokens=256)
    got = run_isolated(
        IW.ingester_killed_mid_run, store, recs, PER_SEGMENT, "after_read_back:tensors", True, timeout=IW.WAIT_S
    )
    assert got["restarts"] == MAX_RESTARTS
    rep = got["report"]
    assert any(f"{MAX_RESTARTS + 1} times; it was not restarted again" in e for e in rep["errors"]), rep
    assert_report_is_the_store(rep, store, recs)


def assert_report_is_the_store(rep, store, recs):
    """The report's written is what the store holds, each record once; nothing spooled, nothing dropped."""
    counts = assert_every_record_once(store, IW.keys_of(recs))
    assert rep["records_written"] == len(counts["tensors"]) == len(recs), rep
    assert rep["records_spooled"] == rep["records_dropped"] == 0, rep
    assert not list_segments(os.path.join(store, "spool"))


# -- 3. the training process killed --------------------------------------------------------------------------------


def test_a_killed_training_leaves_no_ingester_behind_and_its_closed_segments_are_stored(tmp_path):
    store = str(tmp_path / "store")
    flushed, buffered = 24, 3
    train = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "ingester_workers.py"), "train", store, str(flushed), str(buffered)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    lines = []
    try:
        for line in train.stdout:
            lines.append(line)
            if line.startswith("READY "):
                break
        ready = json.loads(lines[-1][len("READY ") :])
    finally:
        train.kill()  # SIGKILL: no close, no final word to the ingester
        train.wait(IW.WAIT_S)
    assert ready["owner"], "".join(lines)
    pid = ready["ingester"]
    # its control stream ends (or its parent is gone): a final pass, then it exits
    IW.wait_until(lambda: gone(pid), f"the orphaned ingester (pid {pid}) to exit", timeout=120)
    status = read_status(store)
    assert status.pid == pid and status.state == "done" and status.waiting_segments == 0, status
    keys = [tuple(k) for k in ready["keys"]]
    assert_every_record_once(store, keys[:flushed])  # every closed segment; the buffer died with the process

    # what is left for later (another rank's segments, spooled after the ingester ended): the next pass takes it
    late = IW.records(1, range(1, 3))
    run_isolated(IW.spool_parquet, store, late, 1, PER_SEGMENT)
    rc, out = ingest_cli(store)
    assert rc == 0 and f"{len(late)} record(s)" in out and "0 segment(s) left" in out, out
    assert_every_record_once(store, keys[:flushed] + IW.keys_of(late))


# -- 4 and 5. a store another ingester holds -----------------------------------------------------------------------


class HandRunIngester:
    """``megatron-dmi ingest STORE --follow`` started by hand (a pass every 0.2 s), stopped with SIGTERM."""

    def __init__(self, store):
        self.store = store
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_dmi", "ingest", store, "--follow", "--poll-seconds", "0.2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        IW.wait_until(self._owns, "the hand-run ingester to own the store")

    def _owns(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the hand-run ingester ended: {self.proc.stdout.read()}")
        s = read_status(self.store)
        return s is not None and s.pid == self.proc.pid and s.owner

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=IW.WAIT_S)
        return self.proc.returncode, out


def test_load_into_a_store_its_ingester_holds_says_who_loads_it(tmp_path):
    store, other = str(tmp_path / "store"), str(tmp_path / "other")
    run_isolated(IW.spool_parquet, store, IW.records(0, range(1, 3)), 0, PER_SEGMENT)  # a run spooled into it
    run_isolated(IW.spool_parquet, other, IW.records(1, range(1, 3)), 1, PER_SEGMENT)
    holder = HandRunIngester(store)
    try:
        rc, out, err = cli("load", os.path.join(store, "spool"), "--store", store)
        assert rc == 0 and out.count("\n") == 1 and not err, (out, err)
        assert f"ingester (pid {holder.proc.pid}) is loading" in out, out
        rc, out, err = cli("load", store, "--store", store)  # the store folder names its spool too
        assert rc == 0 and f"pid {holder.proc.pid}" in out, (out, err)

        rc, out, err = cli("load", other, "--store", store)
        assert rc == 1 and not out and err.count("\n") == 1, (out, err)
        assert f"being ingested by pid {holder.proc.pid}" in err and "after that process ends" in err, err
        assert "Traceback" not in err and "lock" not in err, err

        rc, out, err = cli("show", store)  # a reader reads a snapshot beside it
        assert rc == 0 and "lock" not in out + err and "error" not in err, (out, err)
    finally:
        rc, _ = holder.stop()
    assert rc == 0
    rc, out, err = cli("load", other, "--store", store)  # once it has ended, load goes ahead
    assert rc == 0 and ": 8 record(s)" in out, (out, err)


def test_a_run_on_a_store_another_ingester_holds_is_loaded_by_that_ingester(tmp_path):
    store = str(tmp_path / "store")
    os.makedirs(store)
    recs = IW.records(0, range(1, 9), tokens=256)
    holder = HandRunIngester(store)
    try:
        got = run_isolated(IW.run_beside_a_holder, store, recs, PER_SEGMENT, holder.proc.pid)
    finally:
        rc, out = holder.stop()
    assert rc == 0, out
    standing_down = [ln for ln in got["log"] if ln.startswith("DMI: not ingesting on this node")]
    assert len(standing_down) == 1 and f"pid {holder.proc.pid}" in standing_down[0], got["log"]
    rep = got["report"]
    verified = {(run, a, rank): n for run, a, rank, n, _ in got["holder_after"]["result"]["verified"]}
    assert len(recs) // 2 <= rep["records_written"] <= verified[(IW.RUN, 1, 0)], (rep, verified)
    assert rep["records_written"] + rep["records_spooled"] == len(recs) and rep["records_dropped"] == 0, rep
    if rep["records_spooled"]:
        assert f"the ingester holding the store (pid {holder.proc.pid})" in rep["spooled_note"], rep
    assert not rep["errors"], rep
    # SIGTERM: the holder finished with a final pass
    assert not list_segments(os.path.join(store, "spool"))
    assert read_status(store).state == "done"
    assert_every_record_once(store, IW.keys_of(recs))
