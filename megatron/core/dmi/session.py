"""DMISession: Deep Model Inspection for any training loop built on megatron-core.

A session owns one process's capture pipeline (hooks -> capture -> transport -> drain -> sink) and
takes the step context from the loop that drives it::

    session = DMISession(DMIConfig(hooks=..., store_dir="dmi_store"))   # every rank, same point
    session.attach(model_chunks)                  # one chunk per virtual pipeline stage
    for iteration in range(1, iterations + 1):    # 1-based, as Megatron logs them
        for microbatch_batch in batches:
            session.before_forward(chunk, iteration)   # before every forward of a chunk
            ...forward / backward...
        if saving:
            session.flush()                       # everything captured so far is durable
            state = session.state(iteration)      # store it durably before the checkpoint is written
    report = session.close()                      # collective; report.text for rank 0's log

Resuming: pass the saved ``state["run_id"]`` as ``resumed_run_id`` and the checkpoint's iteration
as ``resumed_from_iteration``; the session continues that run under a new attempt, and the reader
shows each iteration from the latest attempt that captured it.

It uses megatron-core's parallel state only (never ``megatron.training``); ``pretrain_gpt.py``'s
integration (``megatron/training/dmi/runtime.py``) is one client of it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.core.dmi import provenance
from megatron.core.dmi.capture import GATE_ORIGINAL, Capture
from megatron.core.dmi.catalog import check_graph_support
from megatron.core.dmi.config import DMIConfig, check_run_id
from megatron.core.dmi.drain import Drain
from megatron.core.dmi.errors import UnsupportedOperationError
from megatron.core.dmi.hooks.install import HookSet, rank_coords
from megatron.core.dmi.replay.extract import MATCHED_FACTS
from megatron.core.dmi.replay.request import ReplaySourceError
from megatron.core.dmi.replay.routing import RoutingReplay
from megatron.core.dmi.sinks import RunInfo, open_sink
from megatron.core.dmi.sinks.base import SinkReport
from megatron.core.dmi.transport import open_transport


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _world() -> int:
    return torch.distributed.get_world_size() if _dist() else 1


def _broadcast(obj):
    if _world() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def allocate_attempt(store_dir: str, run_id: str) -> int:
    """Attempts are numbered by exclusive creation of a marker file, so a crashed attempt that never
    saved a checkpoint still owns its number and its records stay distinguishable."""
    folder = os.path.join(store_dir, "attempts", check_run_id(run_id))  # also a run id read from a state file
    os.makedirs(folder, mode=0o700, exist_ok=True)
    attempt = 1
    while True:
        try:
            os.close(os.open(os.path.join(folder, str(attempt)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return attempt
        except FileExistsError:
            attempt += 1


def new_run_id() -> str:
    """A fresh run id: the start time and a random suffix."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def default_device() -> torch.device:
    """The current CUDA device where the loop has started using CUDA (its model is there), else the
    CPU (also under the CPU development shim, which never initialises CUDA)."""
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class SessionReport:
    """What a closed session says: this rank's sink report and every rank's one-line summary."""

    run_id: str
    attempt: int
    sink: SinkReport
    lines: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The report as printed: a heading, then every rank's summary line, indented."""
        return f"DMI end-of-run report (run {self.run_id} attempt {self.attempt}):\n  " + "\n  ".join(self.lines)


class DMISession:
    """One process's DMI pipeline. Construct it on every rank at the same point of the loop: it
    agrees on the run id and attempt with collectives (rank 0 decides)."""

    def __init__(
        self,
        config: DMIConfig,
        *,
        resumed_run_id: str | None = None,
        resumed_from_iteration: int | None = None,
        device: torch.device | None = None,
        cuda_graphs: bool = False,
        run_facts: dict[str, Any] | None = None,
        command_line: Sequence[str] | None = None,
    ):
        """``resumed_run_id``/``resumed_from_iteration``: the state of the checkpoint being resumed
        (``state()``), or None for a fresh start. ``cuda_graphs``: the model's forwards replay from
        CUDA graphs, so the step context travels through the device gate and context block.
        ``run_facts``: values the model config does not hold (sequence length, vocabulary, batch
        sizes) for the runs table; ``command_line`` defaults to ``sys.argv``. Raises
        UnsupportedUnderGraphsError for ``grad`` outputs and ``mlp.experts`` with ``cuda_graphs``."""
        if cuda_graphs:
            check_graph_support(config.hooks)
        self.config = config
        run_id, attempt = None, None
        if not _dist() or torch.distributed.get_rank() == 0:
            run_id = config.run_id or resumed_run_id or new_run_id()
            attempt = allocate_attempt(config.store_dir, run_id)
        self.run_id, self.attempt = _broadcast((run_id, attempt))
        self.resumed_from = resumed_from_iteration
        self.run_facts = dict(run_facts or {})
        self.command_line = list(sys.argv if command_line is None else command_line)
        self.coords = rank_coords()
        self.transport = open_transport(config, device or default_device())
        self.sink = open_sink(config, self.coords, self.run_id, is_ingester=int(os.environ.get("LOCAL_RANK", "0")) == 0)
        self.capture = Capture(config, self.transport, self.run_id, self.attempt, graphs=cuda_graphs)
        self.hooks = HookSet(self.capture)
        self.drain = Drain(self.transport, self.sink, batch_records=config.flush_records)
        self._chunks: dict[int, int] = {}  # id(unwrapped chunk) -> virtual pipeline stage
        self._done = False
        self._closed = False
        # close() and seal() may be called from different threads (a signal's seal runs off the
        # training thread when that one does not come back in time): one of them closes, once.
        self._close_lock = threading.Lock()
        self._released = False
        self._step: tuple[str, int] | None = None
        self._microbatch: dict[int, int] = {}
        self._drops_written = 0
        self.replay: RoutingReplay | None = None
        # Under CUDA graphs the producers replay without Python: the device gate and context block
        # carry the step, set on the stream before every forward.
        self._device_context = cuda_graphs
        if cuda_graphs and not hasattr(self.transport, "publish_site"):
            raise UnsupportedOperationError(
                "DMI: CUDA graphs need the native transport, which could not be built here "
                "(run `megatron-dmi doctor --build`)"
            )

    @property
    def description(self) -> str:
        """One line saying what this session captures, through which transport, into which store."""
        c = self.config
        return (
            f"DMI: run {self.run_id} attempt {self.attempt} capturing {', '.join(sorted(c.hooks))} "
            f"via {self.transport.name} transport into {c.persist} ({c.clickhouse_url or c.store_dir})"
        )

    # -- model ------------------------------------------------------------------------------
    def attach(self, chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        """Hooks on every model chunk (index = virtual pipeline stage; wrappers such as DDP are
        looked through), then this rank's row of the runs and topology tables."""
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        new = False
        for vpp, chunk in enumerate(chunks):
            inner = _unwrap(chunk)
            if id(inner) not in self._chunks:
                self._chunks[id(inner)] = vpp
                self.hooks.attach(inner, vpp)
                new = True
        if new:
            self._write_run_info(getattr(_unwrap(chunks[0]), "config", None))
        if self.config.replay_routing and self.replay is None:
            self.replay = self._start_replay([_unwrap(c) for c in chunks])

    def _start_replay(self, chunks: list[torch.nn.Module]) -> RoutingReplay:
        """This rank's routing replay (``config.replay_routing``), checked against this run's model facts."""
        facts = json.loads(json.dumps(provenance.model_summary(chunks[0].config, **self.run_facts), default=str))
        layout = provenance.parallel_layout()
        needed = ("seq_length", "micro_batch_size", "global_batch_size")
        if any(facts.get(name) is None for name in needed):
            raise ReplaySourceError(f"routing replay needs the run facts {', '.join(needed)} (DMISession run_facts)")
        microbatches = facts["global_batch_size"] // (facts["micro_batch_size"] * layout["dp"])
        return RoutingReplay.start(
            self.config.replay_routing,
            self.config.replay_missing,
            chunks,
            {name: facts.get(name) for name, _ in MATCHED_FACTS},
            microbatches,
            self.coords,
            layout,
            bool(chunks[0].config.sequence_parallel),
        )

    def _write_run_info(self, model_config) -> None:
        config = {
            k: (sorted(v) if isinstance(v, frozenset) else v)
            for k, v in vars(self.config).items()
            if k != "clickhouse_password"
        }
        self.sink.write_run(
            RunInfo(
                run_id=self.run_id,
                attempt=self.attempt,
                resumed_from_iteration=self.resumed_from,
                config=config,
                coords=self.coords,
                layers=sorted(self.hooks.layers),
                world_size=_world(),
                model=provenance.model_summary(model_config, **self.run_facts),
                layout=provenance.parallel_layout(),
                command_line=self.command_line,
            )
        )

    # -- the step context -------------------------------------------------------------------
    def before_forward(
        self, chunk: torch.nn.Module, iteration: int, phase: str | None = None, capture: bool = True
    ) -> None:
        """Call before every forward of a model chunk. ``iteration`` is 1-based; ``phase`` defaults
        to ``train`` or ``valid`` from the chunk's training flag. The microbatch index is the count
        of this chunk's forwards within the step (every Megatron schedule runs one chunk's
        microbatches in order); a new (phase, iteration) starts a new step. ``capture=False`` on the
        call that starts a step leaves that step uncaptured whatever the config says (the per-step
        switch of benchmarks/step_time_paired.py, which alternates DMI on and off)."""
        if self._done:
            return
        inner = _unwrap(chunk)
        if id(inner) not in self._chunks:  # a chunk built outside the loop's list
            self.attach([inner])
        step = (phase or ("train" if chunk.training else "valid"), int(iteration))
        if step != self._step:
            self._step = step
            self._microbatch.clear()
            self.capture.begin_step(*step, wanted=capture)
            self._write_new_drops()
            if self._device_context:
                self.transport.set_gate_word(GATE_ORIGINAL if self.capture.step.active else 0)
        microbatch = self._microbatch.get(id(inner), 0)
        self._microbatch[id(inner)] = microbatch + 1
        self.capture.set_microbatch(microbatch)
        if self.replay is not None:
            self.replay.before_forward(step[0], step[1], microbatch, self._chunks[id(inner)])
        if self._device_context and self.capture.step.active:
            self.transport.set_context(
                iteration=step[1], microbatch=microbatch, attempt=self.attempt, phase=step[0], invocation=0
            )

    def end_capture(self) -> None:
        """Later forwards (e.g. evaluations after the loop) are not captured."""
        self._done = True
        self.capture.begin_step("done", -1)
        if self.replay is not None:
            self.replay.stop()
        if self._device_context:
            self.transport.set_gate_word(0)

    def _write_new_drops(self) -> None:
        keys = self.capture.stats.dropped_keys
        if len(keys) > self._drops_written:
            self.sink.write_drops(keys[self._drops_written :], reason="ring full (--dmi-on-full drop)")
            self._drops_written = len(keys)

    # -- checkpoints ------------------------------------------------------------------------
    def flush(self) -> None:
        """Returns once every record captured so far is in the spool or store and durable (at once
        after ``close``/``seal``: there is nothing left to flush)."""
        if self._closed:
            return
        self._write_new_drops()
        self.drain.flush()

    def state(self, iteration: int) -> dict[str, Any]:
        """What to save for the checkpoint of ``iteration`` to resume this run later; write it
        durably before the checkpoint itself, so every checkpoint that exists has it."""
        return {"run_id": self.run_id, "attempt": self.attempt, "iteration": int(iteration)}

    # -- progress ---------------------------------------------------------------------------
    def status_line(self) -> str:
        """The log-interval line: records captured, dropped, waiting in the drain, persisted and not yet in the
        store, rejected replays and, when any, time spent waiting for ring space and at the spool bound."""
        t = self.transport.stats
        lag = self.sink.store_lag()  # once per line: it stats every waiting spool segment
        store = (
            f"store lag: {lag.rows} records, {lag.seconds:.0f} s"
            if lag is not None
            else f"store: none ({self.config.persist})"
        )
        return (
            f" DMI | captured: {t.published} records {t.published_bytes / 2**20:.1f} MiB |"
            f" dropped: {t.dropped} | drain lag: {self.drain.lag_records} records |"
            f" persisted: {self.drain.records_persisted} records | {store} |"
            f" replays rejected: {self.capture.stats.replays_rejected} |"
            + (f" waited for ring space: {t.blocked_seconds:.2f} s ({t.blocked} records) |" if t.blocked else "")
            + self._bound_note(" {seconds:.1f} s at the spool bound ({spells}x) |")
            + (f" {self.replay.status} |" if self.replay is not None else "")
        )

    # -- the end ----------------------------------------------------------------------------
    def close(self) -> SessionReport:
        """Flush, stop and close everything; collective on multi-rank runs (non-ingesting ranks
        finish their spool before the node's ingester makes its final pass). Idempotent."""
        with self._close_lock:
            if not self._closed:
                self._close()
            self._release_model()  # after a seal too: the training thread may go on without DMI
            return self._report

    def _close(self) -> None:
        self.flush()
        self._closed = True
        self.drain.close()
        self._release_model()
        ingester = self.sink.is_ingester
        report = None if ingester else self.sink.close()
        if _world() > 1:
            torch.distributed.barrier()  # every rank's spool is complete before the final ingest
        if ingester:
            report = self.sink.close()
        lines = [self._report_line(report)]
        if _world() > 1:
            gathered = [None] * _world()
            torch.distributed.all_gather_object(gathered, lines[0])
            lines = gathered
        self._report = SessionReport(self.run_id, self.attempt, report, lines)

    def _release_model(self) -> None:
        """Give the model back (routing replay's wrappers, then the hooks: replay wrapped the routers
        after them) and free the ring; once."""
        if self._released:
            return
        self._released = True
        if self.replay is not None:
            self.replay.close()
        self.hooks.remove()
        self.transport.close()

    def seal(self) -> SessionReport:
        """Close this rank alone, for a process that is ending (on a signal): capture stops, every
        record published so far goes through the drain into the sink, and the sink closes (its open
        spool segment written and fsync'd; the node's ingester loads what it can into the store).
        Unlike ``close`` it runs no collective (the other ranks may be gone or stuck) and leaves the
        hooks and the transport in place, so it may run on a thread other than the training thread;
        the report holds this rank's line only. Idempotent, and a no-op after ``close``."""
        with self._close_lock:
            if self._closed:
                return self._report
            self.end_capture()
            self.flush()
            self._closed = True
            self.drain.close()
            report = self.sink.close()
            self._report = SessionReport(self.run_id, self.attempt, report, [self._report_line(report)])
            return self._report

    def where(self) -> str:
        """One line saying where this session's records are: the store and the spool folder, and how
        spooled records get into the store."""
        c = self.config
        spool = os.path.join(c.store_dir, "spool")
        if c.persist == "none":
            return "nothing is kept (--dmi-persist none)"
        if c.persist == "spool":
            return (
                f"written = segments in {spool}; load them with `megatron-dmi load {c.store_dir} --store <dir-or-url>`"
            )
        if c.clickhouse_url:
            return (
                f"written = in the server's database {c.clickhouse_database}; spooled = in {spool}, "
                f"`megatron-dmi ingest {c.store_dir} --clickhouse-url <url>` inserts them"
            )
        return (
            f"written = in the store {c.store_dir}; spooled = in {spool}, loaded into the store when it is "
            f"next opened (`megatron-dmi show {c.store_dir}`)"
        )

    def _bound_note(self, text: str) -> str:
        """``text`` filled with the drain's time at the spool bound and its spells; empty if it never got there."""
        d = self.drain
        return text.format(seconds=d.bound_seconds, spells=d.bound_spells) if d.bound_spells else ""

    def _report_line(self, report: SinkReport) -> str:
        t = self.transport.stats
        return (
            f"rank {self.coords.rank}: captured {t.published} records ({t.published_bytes} B), "
            f"written {report.records_written} ({report.bytes_written} B), spooled {report.records_spooled}"
            + (f" ({report.spooled_note})" if report.records_spooled and report.spooled_note else "")
            + ", "
            f"dropped {t.dropped + report.records_dropped}, replays rejected {self.capture.stats.replays_rejected}"
            + (
                f", waited for ring space {t.blocked_seconds:.2f} s ({t.blocked} records): raise --dmi-ring-mb"
                " or see docs/troubleshooting.md"
                if t.blocked
                else ""
            )
            + self._bound_note(
                ", {seconds:.1f} s at the --dmi-spool-max-gb bound ({spells} time(s)): the store's ingest "
                "fell behind capture, see docs/reliability.md"
            )
            + (f", {self.replay.status}" if self.replay is not None else "")
            + (
                f", store complete {report.store_complete_s:.1f} s after close began"
                if report.store_complete_s is not None
                else ""
            )
            + (f", errors: {'; '.join(report.errors)}" if report.errors else "")
        )
