"""The drain: a background thread moving finished records from the transport to the sink.

It is the only consumer of the transport and the only caller of ``Sink.write``, so the training
thread never waits on persistence (except under ``--dmi-on-full block`` when the ring is full).

When the sink ends in spool files and the transport is the native ring, the ring's own C++
spool writer consumes it instead (no Python, no GIL per batch: every GIL round trip of a
background thread delays the training thread's next kernel launches); this thread then only
answers flushes and relays the writer's progress to the sink.

Spool bound (``--dmi-spool-max-gb``): when the bytes waiting in the rank's spool for the store
reach the sink's bound, the drain stops taking records (the native writer is held), so the ring
fills and its ``--dmi-on-full`` policy applies: producers wait (``block``, up to
``--dmi-block-timeout``, then drop) or drop (``drop``), every drop counted and its key stored. DMI
says so when a spell at the bound starts and ends, and counts the time spent there. Flushes and
``close`` still write everything published before them, past the bound if need be.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings

import pyarrow as pa

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.sinks.base import Sink, SpoolBacklog
from megatron.core.dmi.transport.base import Transport

log = logging.getLogger(__name__)


class Drain:
    """``batch_records``: the most records handed to the sink in one batch (``--dmi-flush-records``).
    ``linger_bytes``: while nothing waits on a flush, each take waits up to ``poll_seconds`` for
    that much payload, so small records leave in few batches: every batch costs a GIL round trip,
    and each one makes the training thread yield the GIL (see NativeRingTransport.take_table).
    Default: 32 MiB or a quarter of the ring, whichever is smaller. ``native_spool=False`` keeps
    the Python consumer even where the ring's C++ spool writer could be used (comparisons, tests)."""

    PROGRESS_SECONDS = 0.5  # how often the native writer's progress is relayed to the sink
    FLUSH_TIMEOUT = 600.0

    def __init__(
        self,
        transport: Transport,
        sink: Sink,
        batch_records: int = DMIConfig.flush_records,
        poll_seconds: float = 0.05,
        linger_bytes: int | None = None,
        native_spool: bool = True,
    ):
        """Start draining ``transport`` into ``sink``: the drain thread, and the ring's native spool writer where
        both allow it."""
        self.transport = transport
        self.sink = sink
        self.batch_records = batch_records
        self.poll_seconds = poll_seconds
        self.linger_bytes = min(32 << 20, transport.ring_bytes // 4) if linger_bytes is None else linger_bytes
        self._records = 0  # handed to the sink (native: as of the last relay)
        self.batches_written = 0
        self.sink_errors: list[str] = []
        self._native_errors_seen = 0
        self.holding = False  # the consumer takes nothing: the spool is at its bound
        self.bound_spells = 0  # times the spool reached its bound
        self._bound_seconds = 0.0  # time spent at the bound in finished spells
        self._bound_since: float | None = None  # when the current spell began
        target = sink.native_spool_target() if native_spool and hasattr(transport, "start_spool") else None
        self.native = target is not None
        if self.native:
            transport.start_spool(**target, linger_bytes=self.linger_bytes, poll_seconds=poll_seconds)
            sink.native_started(transport.spool_stats)
        self._stop = threading.Event()
        # Flush requests are answered by the drain thread itself: only it takes records, so only it
        # knows when everything taken has also been written.
        self._flush_requests: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dmi-drain", daemon=True)
        self._thread.start()

    def _write(self, table: pa.Table) -> None:
        try:
            self.sink.write_table(table)
            self._records += table.num_rows
            self.batches_written += 1
        except Exception as exc:  # the sink spools on its own; anything else must not kill training
            msg = f"sink write of {table.num_rows} records failed: {exc!r}"
            log.error("DMI: %s", msg)
            self.sink_errors.append(msg)

    def _answer_flushes(self) -> None:
        while True:
            try:
                self._flush_requests.get_nowait().set()
            except queue.Empty:
                return

    @property
    def records_persisted(self) -> int:
        """Records handed to the sink (native: written into spool segments, live)."""
        live = self.transport.spool_stats() if self.native else None
        return live["records"] if live else self._records

    @property
    def bound_seconds(self) -> float:
        """Time the drain spent holding at the spool bound, the current spell included."""
        since = self._bound_since
        return self._bound_seconds + (0.0 if since is None else time.monotonic() - since)

    def _at_bound(self) -> bool:
        """Whether the sink's spool is at its bound; says so when a spell starts or ends."""
        backlog = self.sink.spool_backlog()
        full = backlog is not None and backlog.full
        if full and self._bound_since is None:
            self._bound_since = time.monotonic()
            self.bound_spells += 1
            msg = self._bound_message(backlog)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.error(msg)
        elif not full and self._bound_since is not None:
            spell = time.monotonic() - self._bound_since
            self._bound_seconds += spell
            self._bound_since = None
            waiting = backlog.waiting_bytes if backlog is not None else 0
            log.warning(
                "DMI: the spool in %s is below the --dmi-spool-max-gb bound again (%.2f GiB waiting for the "
                "store); capture resumes after %.1f s at the bound",
                backlog.folder if backlog is not None else "the spool",
                waiting / 2**30,
                spell,
            )
        return full

    def _bound_message(self, backlog: SpoolBacklog) -> str:
        t = self.transport
        then = (
            f"producers wait for ring space (--dmi-on-full block), each up to --dmi-block-timeout "
            f"{t.block_timeout:g} s, then its record is dropped and counted"
            if t.on_full == "block"
            else "records the ring cannot hold are dropped (--dmi-on-full drop), counted and their keys stored"
        )
        return (
            f"DMI: the spool in {backlog.folder} holds {backlog.waiting_bytes / 2**30:.2f} GiB waiting for the "
            f"store, at the --dmi-spool-max-gb bound ({backlog.max_bytes / 2**30:.2f} GiB; reached "
            f"{self.bound_spells} time(s) so far): the store's "
            f"ingest is not keeping up with capture; the drain stops taking records until it does, so "
            f"capture now waits or drops: {then}"
        )

    def _run(self) -> None:
        if self.native:
            return self._run_native()
        while True:
            urgent = self._stop.is_set() or not self._flush_requests.empty()
            if not urgent:
                self.holding = self._at_bound()
                if self.holding:
                    self._stop.wait(self.poll_seconds)  # a flush waits at most this long to be seen
                    continue
            table = self.transport.take_table(self.batch_records, self.poll_seconds, 0 if urgent else self.linger_bytes)
            if table is not None:
                self._write(table)
            if self.transport.pending() == 0:
                if not self._flush_requests.empty():
                    self.sink.flush()
                    self._answer_flushes()
                if self._stop.is_set():
                    return

    def _run_native(self) -> None:
        while True:
            try:
                request = self._flush_requests.get(timeout=self.PROGRESS_SECONDS)
            except queue.Empty:
                request = None
            if not self.transport.spooling:  # the transport was closed under a running drain
                log.error("DMI: transport closed before its drain; the drain stops")
                self._answer_flushes()
                return
            if self._stop.is_set():
                stats, closed = self.transport.stop_spool()  # writes everything, held or not
                self._relay(stats, closed)
                self.sink.flush()
                if request is not None:
                    request.set()
                return
            if request is not None:
                if not self.transport.spool_flush(self.FLUSH_TIMEOUT):  # held or not
                    self.sink_errors.append(f"native spool flush did not finish within {self.FLUSH_TIMEOUT:.0f} s")
                self._relay(*self.transport.spool_progress())
                self.sink.flush()
                request.set()
                self._answer_flushes()
            else:
                self._relay(*self.transport.spool_progress())
            held = self._at_bound()
            if held != self.holding:
                self.transport.spool_hold(held)
                self.holding = held

    def _relay(self, stats: dict, closed: list) -> None:
        """Counters and closed segments to the sink (every PROGRESS_SECONDS), which reports the
        writer's errors at close."""
        self._records = stats["records"]
        for msg in stats["errors"][self._native_errors_seen :]:  # say it when it happens, loudly
            warnings.warn(f"DMI: {msg}", RuntimeWarning, stacklevel=2)
            log.error("DMI: %s", msg)
        self._native_errors_seen = len(stats["errors"])
        self.sink.native_progress(stats, closed)

    @property
    def lag_records(self) -> int:
        """Records captured but not yet handed to the sink."""
        return self.transport.pending()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record published so far is written to the sink and the sink flushed."""
        self.transport.settle()
        done = threading.Event()
        self._flush_requests.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Stop the drain once everything published so far is handed to the sink, and release any flush still
        waiting; the sink stays open."""
        self.transport.settle()
        self._stop.set()
        if self.native:
            self._flush_requests.put(threading.Event())  # wake the thread now
        self._thread.join()
        self._answer_flushes()
        if self._bound_since is not None:  # the spell ends with the drain
            self._bound_seconds += time.monotonic() - self._bound_since
            self._bound_since = None
