"""Workers of test_ingester_process.py: records, spool writers, a training process to kill, and plain SQL counts
of a store, each run in a process of its own (chDB: one store per process).

Functions are module-level so ``run_isolated`` can ship them to a fresh process. Run as a script, this module is
a training process whose node ingester runs (what the test then kills):

    python tests/fault_tests/ingester_workers.py train STORE FLUSHED BUFFERED

writes FLUSHED records (in closed, fsync'd spool segments) and BUFFERED more that stay in the sink's buffer,
prints ``READY {"ingester": PID, "flushed": N, ...}`` and sleeps until it is killed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron.core.dmi.key import ParallelCoords  # noqa: E402
from tests.unit_tests.dmi.sinks import workers as W  # noqa: E402

RUN = W.RUN
WAIT_S = 300  # a bound on every wait for another process: generous, for a loaded 2-core machine


def records(rank: int, iterations, layers=(0, 1), tokens: int = 2048, experts: int = 64, seed: int = 0) -> list:
    """Per (iteration, layer) a ``router.logits`` record (tokens x experts float32: 512 KiB by default) and a
    ``router.expert_counts`` record (its derived rows go to ``dmi.expert_counts``), all keyed on ``rank``."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for it in iterations:
        for layer in layers:
            kw = dict(iteration=it, layer=layer, rank=rank, dp=rank)
            out.append(W.rec("router.logits", torch.randn(tokens, experts, generator=g), **kw))
            counts = torch.randint(0, tokens, (2, experts), generator=g, dtype=torch.int32)
            out.append(W.rec("router.expert_counts", counts, **kw))
    return out


def keys_of(recs: list) -> list[tuple]:
    """(output, iteration, layer, rank) of each record: what ``count_per_key`` counts by."""
    return [(r.key.output, r.key.iteration, r.key.layer, r.key.coords.rank) for r in recs]


def wait_until(cond, what: str, timeout: float = WAIT_S, step: float = 0.05):
    """Poll ``cond()`` until it is true (returns its value); AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


# -- spool writers (no store opened) ------------------------------------------------------------------------------


def spool_native(store_dir: str, recs: list, per_segment: int) -> int:
    """Rank 0's records through the native ring and spool writer, as a training run writes them: ``.dmiraw``
    segments of ``per_segment`` records, plus the run's metadata segments. Returns the records written."""
    from megatron.core.dmi.config import DMIConfig
    from megatron.core.dmi.drain import Drain
    from megatron.core.dmi.sinks import SpoolSink
    from megatron.core.dmi.transport.native import NativeRingTransport

    ring = NativeRingTransport(64 << 20, "block", "cpu", block_timeout=DMIConfig.block_timeout)
    sink = SpoolSink(RUN, ParallelCoords(rank=0), os.path.join(store_dir, "spool"), segment_bytes=1 << 30)
    drain = Drain(ring, sink, linger_bytes=0)
    assert drain.native
    sink.write_run(W.run_info())
    for i in range(0, len(recs), per_segment):
        for r in recs[i : i + per_segment]:
            assert ring.publish(r.key, r.tensor())
        sent = min(i + per_segment, len(recs))
        wait_until(lambda n=sent: ring.spool_stats()["records"] >= n, "the native writer")
        drain.flush()  # closes the segment
    drain.close()
    ring.close()
    return sink.close().records_written


def spool_parquet(store_dir: str, recs: list, rank: int, per_segment: int) -> int:
    """One rank's records as Parquet spool segments of ``per_segment`` records (the Python spool writer)."""
    from megatron.core.dmi.sinks import SpoolSink

    sink = SpoolSink(
        RUN, ParallelCoords(rank=rank), os.path.join(store_dir, "spool"), writers=1, segment_records=per_segment
    )
    sink.write_run(W.run_info(rank=rank, world=2))
    for i in range(0, len(recs), per_segment):
        sink.write(recs[i : i + per_segment])  # a segment closes once a batch brings it to per_segment
    return sink.close().records_written


# -- reading a store ------------------------------------------------------------------------------------------------


def store_backend(store: str):
    """The backend of a store's address: a ClickHouse server URL, else the embedded store of a store folder."""
    from megatron.core.dmi.store.backend import ChdbBackend, ServerBackend

    return ServerBackend(store) if "://" in store else ChdbBackend(os.path.join(store, "chdb"))


def count_per_key(store: str) -> dict:
    """Plain SQL on the store itself (a store folder's embedded store, or a server URL; nothing ingested first),
    as a reader sees it (FINAL): rows per (output, iteration, layer, rank) of ``dmi.tensors``, rows and distinct
    experts per record of ``dmi.expert_counts``; tensor segments recorded in ``dmi.segments``; and keys of
    ``dmi.tensors`` whose physical copies (before a merge collapses them) differ, and segment ids recorded more
    than once."""
    from megatron.core.dmi.store import schema as S

    b = store_backend(store)
    try:
        tensors = b.query_arrow(
            f"SELECT output, iteration, layer, rank, count() AS n FROM {b.t('tensors')} FINAL "
            "GROUP BY output, iteration, layer, rank"
        ).to_pylist()
        # one row per expert of each router.expert_counts record: rows and distinct experts per record
        experts = b.query_arrow(
            f"SELECT iteration, layer, rank, count() AS n, uniqExact(expert) AS e FROM {b.t('expert_counts')} FINAL "
            "GROUP BY iteration, layer, rank"
        ).to_pylist()
        key = ", ".join(S.ORDER_BY["tensors"])
        differing = b.query_arrow(
            f"SELECT {key} FROM {b.t('tensors')} GROUP BY {key} HAVING uniqExact(checksum, payload) > 1"
        ).num_rows
        twice = b.query_arrow(
            f"SELECT segment_id FROM {b.t('segments')} FINAL GROUP BY segment_id HAVING count() > 1"
        ).num_rows
        recorded = b.query_arrow(f"SELECT count() AS n FROM {b.t('segments')} FINAL WHERE kind = 'tensors'")
        return {
            "tensor_segments_recorded": recorded.column("n")[0].as_py(),
            "tensors": {(r["output"], r["iteration"], r["layer"], r["rank"]): r["n"] for r in tensors},
            "expert_counts": {
                ("router.expert_counts", r["iteration"], r["layer"], r["rank"]): (r["n"], r["e"]) for r in experts
            },
            "differing_copies": differing,
            "segments_twice": twice,
        }
    finally:
        b.close()


def supervised_pass(store_dir: str, url: str | None = None) -> dict:
    """What a new training run's supervisor does on a store (into the server at ``url``, if given): start the
    ingester process, then finish it."""
    from megatron.core.dmi.store.ingester import IngesterProcess

    ing = IngesterProcess(store_dir, poll_s=0.2, url=url).start()
    ing.finish()
    return {"owner": ing.owner, "result": ing.result.to_dict()}


# -- a training run's sink on local rank 0 --------------------------------------------------------------------------


class _Lines(logging.Handler):
    """Keeps the DMI log lines of warning level and up (what the training's log shows)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _capture_log() -> _Lines:
    h = _Lines()
    logging.getLogger("megatron.core.dmi.sinks").addHandler(h)
    return h


def _sink(
    store_dir: str,
    per_segment: int,
    poll_s: float = 0.2,
    segment_seconds: float = 2.0,
    url: str | None = None,
    threads: int | None = None,
):
    """Local rank 0's StoreSink (its ingester process running) into the embedded store, or the server at ``url``
    with ``threads`` parallel inserts; the run's metadata written."""
    from megatron.core.dmi.sinks import StoreSink

    sink = StoreSink(
        store_dir,
        RUN,
        ParallelCoords(rank=0),
        True,
        ingest_poll_s=poll_s,
        writers=1,
        segment_records=per_segment,
        segment_seconds=segment_seconds,
        url=url,
        ingest_threads=threads,
    )
    sink.write_run(W.run_info())
    return sink


def ingester_killed_mid_run(store_dir: str, recs: list, per_segment: int, crash_at: str = "", every: bool = False):
    """Local rank 0's StoreSink writes ``recs``; a third of the way in, its ingester process is SIGKILLed
    (mid-pass, if one is running), or, with ``crash_at`` (``$DMI_TEST_CRASH_AT`` of the first ingester, or with
    ``every`` of every restarted one too, until the supervisor gives up), it kills itself there in its first pass
    with records. The sink goes on writing. Returns the pids, the restarts, the log's warnings and errors, and
    the report."""
    from megatron.core.dmi.store.ingest import TEST_CRASH_ENV
    from megatron.core.dmi.store.ingester import MAX_RESTARTS

    log = _capture_log()
    if crash_at:
        os.environ[TEST_CRASH_ENV] = crash_at
    sink = _sink(store_dir, per_segment)
    if not every:
        os.environ.pop(TEST_CRASH_ENV, None)  # restarted ingesters run without it
    ing = sink.ingester
    victim = ing._proc.pid
    third = len(recs) // 3
    for r in recs[:third]:
        sink.write([r])
    if not crash_at:
        wait_until(lambda: ing.status and ing.status.passes, "the ingester's first pass")
        sink.flush()  # and kill it while it loads what was written so far (or about to)
        os.kill(victim, 9)
    for r in recs[third:]:  # training goes on spooling while the supervisor restarts its ingester
        sink.write([r])
    restarted = wait_until(
        lambda: ing.status if ing.status and ing.status.pid != victim else None, "a status of a restarted ingester"
    )
    if every:
        given_up = f"{MAX_RESTARTS + 1} times; it was not restarted again"
        wait_until(lambda: any(given_up in e for e in ing.errors), "the supervisor to give up on its ingester")
        os.environ.pop(TEST_CRASH_ENV)  # the pass at close, in a fresh ingester, runs without it
    rep = sink.close()
    return {
        "killed": victim,
        "restarted_pid": restarted.pid,
        "restarts": ing.restarts,
        "log": log.lines,
        "report": dataclasses.asdict(rep),
    }


def run_beside_a_holder(store_dir: str, recs: list, per_segment: int, holder_pid: int) -> dict:
    """Local rank 0's StoreSink on a store another process (``holder_pid``) ingests: write half, flush, wait
    until the holder has loaded that half, write the rest, close. Returns the log's warnings, the holder's
    status right after close, and the report."""
    from megatron.core.dmi.store.ingester import read_status

    log = _capture_log()
    sink = _sink(store_dir, per_segment)
    half = len(recs) // 2
    sink.write(recs[:half])
    sink.flush()

    def holder_loaded() -> bool:
        s = read_status(store_dir)
        got = dict(((run, a, rank), n) for run, a, rank, n, _ in (s.result.get("verified", []) if s else []))
        return s is not None and s.pid == holder_pid and got.get((RUN, 1, 0), 0) >= half

    wait_until(holder_loaded, "the holder to load the first half")
    sink.write(recs[half:])
    rep = sink.close()
    after = read_status(store_dir)
    return {"log": log.lines, "report": dataclasses.asdict(rep), "holder_after": after.__dict__}


def train(store_dir: str, flushed: int, buffered: int) -> None:
    """The script's ``train``: a training process's local rank 0 with its ingester running; see the module's doc.
    Records of the closed segments are keyed on iterations 1.., the buffered ones follow them."""
    recs = records(0, range(1, 1 + (flushed + buffered) // 4 + 1), tokens=64)[: flushed + buffered]
    # no aged-segment timer: the buffered records stay buffered until the kill
    sink = _sink(store_dir, per_segment=max(1, flushed // 4), poll_s=0.5, segment_seconds=3600)
    sink.write(recs[:flushed])
    sink.flush()
    sink.write(recs[flushed:])
    status = wait_until(lambda: sink.ingester.status, "the ingester's first status")
    ready = {"ingester": sink.ingester._proc.pid, "owner": status.owner, "flushed": flushed, "keys": keys_of(recs)}
    print("READY " + json.dumps(ready), flush=True)
    time.sleep(WAIT_S)
    raise SystemExit("not killed")


if __name__ == "__main__":
    if sys.argv[1] != "train":
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
    train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
