"""The concrete sinks: spool files, a store (spool + per-node ingester into embedded chDB or a
ClickHouse server) and a null sink.

Threading: the drain thread calls ``write_table``; the training thread may call ``write_run``,
``write_drops``, ``flush`` and ``close`` at the same time. Buffers sit behind a short lock; database
I/O and metadata segments are serialised by a second lock, so ``write_drops`` never waits for I/O.
Spool sinks write tensor segments from a small pool of writer threads (Parquet writing and zlib
release the GIL), so persistence scales past one core; at most ``writers`` segments are in flight,
after which the drain thread waits (and the ring fills, as with any slow sink).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc

from megatron.core.dmi.errors import InvalidArgumentError
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import table_nbytes
from megatron.core.dmi.sinks.base import Sink, SpoolBacklog, Waiting
from megatron.core.dmi.sinks.meta import (
    DMISinkReport,
    RunInfo,
    drops_table,
    report_table,
    runs_table,
    topology_table,
)
from megatron.core.dmi.sinks.owner import claim_rank_dir, release_rank_dir
from megatron.core.dmi.sinks.spool import SpoolWriter
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store.ingest import IngestResult
from megatron.core.dmi.store.ingester import IngesterProcess, live_ingester, read_status

log = logging.getLogger("megatron.core.dmi.sinks")


class DMISink(Sink):
    """Base of every DMI sink: the Sink contract plus run metadata and drops."""

    name = "base"

    def __init__(self, run_id: str, coords: ParallelCoords):
        """A sink for ``run_id`` on the rank at ``coords``, with an empty report."""
        self.run_id = run_id
        self.coords = coords
        self.attempt = 0
        self.report = DMISinkReport(sink=self.name)
        self._closed = False
        self._buf_lock = threading.Lock()

    def write_run(self, info: RunInfo) -> None:
        """Record the run/attempt, its config and versions, and this rank's topology row."""
        self.attempt = int(info.attempt)

    def write_drops(self, keys: Sequence[RecordKey], reason: str) -> None:
        """Record the keys of records lost before reaching the sink (e.g. ring full)."""

    def _error(self, msg: str) -> None:
        with self._buf_lock:
            self.report.errors.append(msg)


class NullSink(DMISink):
    """``--dmi-persist none``: counts and discards (for overhead measurements)."""

    name = "none"

    def write_table(self, table: pa.Table) -> None:
        """Count the table's records and bytes as discarded."""
        n = table_nbytes(table)
        with self._buf_lock:
            self.report.records_discarded += table.num_rows
            self.report.bytes_discarded += n

    def write_drops(self, keys, reason):
        """Count the dropped keys; nothing is written."""
        with self._buf_lock:
            self.report.drops_recorded += len(keys)

    def close(self) -> DMISinkReport:
        """Mark the sink closed and return its report."""
        self._closed = True
        return self.report


def default_spool_writers() -> int:
    """Writer threads per process: half the cores, at most 4 (1, i.e. inline, on a 2-core VM)."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class SpoolSink(DMISink):
    """``--dmi-persist spool``: Parquet segments only; ``megatron-dmi load`` loads them into a store later.

    Buffers batches into segments of ``segment_bytes``/``segment_records``, or whatever is buffered
    ``segment_seconds`` after its first batch (a timer: live readers see a step's records within seconds
    even when no further batch comes), and writes each to the spool: inline when ``writers`` is 1, else on
    one of ``writers`` threads. ``spool_max_bytes`` bounds the tensor segments waiting in this rank's spool
    for a store (``spool_backlog``; None: no bound)."""

    name = "spool"

    def __init__(
        self,
        run_id: str,
        coords: ParallelCoords,
        spool_root: str,
        *,
        segment_bytes: int = 256 << 20,  # few, large segments: few GIL round trips per byte
        segment_records: int = 8192,
        segment_seconds: float = 2.0,
        writers: int | None = None,
        spool_max_bytes: int | None = None,
    ):
        """Spool under ``spool_root`` with ``writers`` writer threads (None: ``default_spool_writers()``)."""
        super().__init__(run_id, coords)
        self.spool_root = spool_root
        self.spool = SpoolWriter(spool_root, coords.rank, run_id)
        claim_rank_dir(self.spool.dir, run_id)  # refuses a second live run on this store, before any write
        self.segment_bytes = segment_bytes
        self.segment_records = segment_records
        self.segment_seconds = segment_seconds
        if spool_max_bytes is not None and spool_max_bytes < 1:
            raise InvalidArgumentError(f"spool_max_bytes must be >= 1 or None, not {spool_max_bytes}")
        self.spool_max_bytes = spool_max_bytes
        self._buf: list[pa.Table] = []
        self._buf_rows = 0
        self._buf_bytes = 0
        self._buf_since = 0.0
        self._drops: list[tuple[RecordKey, str, datetime]] = []
        self._io_lock = threading.Lock()
        if writers is None:
            writers = default_spool_writers()
        if writers < 1:
            raise InvalidArgumentError(f"writers must be >= 1, not {writers}")
        self.writers = writers
        self._pool = ThreadPoolExecutor(writers, thread_name_prefix="dmi-spool") if writers > 1 else None
        self._slots = threading.BoundedSemaphore(writers)
        self._inflight: dict[Future, tuple[int, int]] = {}  # segment writes in flight -> their rows and bytes
        self._native: dict = {}  # the native spool writer's latest counters, if it writes our segments
        self._native_live = None  # and how to read them now

    # -- contract ---------------------------------------------------------------------------
    def write_table(self, table: pa.Table) -> None:
        """Buffer ``table``; write the buffer as a segment once it is due (or drop and count it after close)."""
        if table.num_rows == 0:
            return
        nbytes = table_nbytes(table)
        with self._buf_lock:
            if self._closed:
                self.report.records_dropped += table.num_rows
                self.report.bytes_dropped += nbytes
                self.report.errors.append(f"{table.num_rows} record(s) written after close() were dropped")
                return
            if not self._buf:
                self._buf_since = time.monotonic()
                timer = threading.Timer(self.segment_seconds, self._close_aged_segment)
                timer.daemon = True
                timer.start()
            self._buf.append(table)
            self._buf_rows += table.num_rows
            self._buf_bytes += nbytes
            due = (
                self._buf_bytes >= self.segment_bytes
                or self._buf_rows >= self.segment_records
                or time.monotonic() - self._buf_since >= self.segment_seconds
            )
        if due:
            self._drain_buffers(records_only=True)

    def _close_aged_segment(self) -> None:
        with self._buf_lock:
            due = (
                not self._closed
                and bool(self._buf)
                and time.monotonic() - self._buf_since >= self.segment_seconds * 0.999
            )
        if due:
            self._drain_buffers(records_only=True)

    def write_run(self, info: RunInfo) -> None:
        """Write the run's runs and topology segments."""
        super().write_run(info)
        with self._io_lock:
            self._emit_meta("runs", runs_table(info))
            self._emit_meta("topology", topology_table(info))

    def write_drops(self, keys: Sequence[RecordKey], reason: str) -> None:
        """Keep the dropped keys for the drops segment the next ``flush()`` writes."""
        now = datetime.now(UTC)
        with self._buf_lock:
            self._drops.extend((k, reason, now) for k in keys)
            self.report.drops_recorded += len(keys)

    def _unwritten(self) -> tuple[int, int]:
        """Rows and bytes buffered or being written to a segment (by Python or the native writer)."""
        live = self._native_live() if self._native_live else None
        with self._buf_lock:
            native = live or self._native
            rows = self._buf_rows + sum(n for n, _ in self._inflight.values()) + native.get("open_rows", 0)
            nbytes = self._buf_bytes + sum(b for _, b in self._inflight.values()) + native.get("open_bytes", 0)
        return rows, nbytes

    def _store_lag(self) -> Waiting:
        """What is unwritten plus this rank's tensor segments still in the spool (one ``waiting()`` call,
        which also says how long the oldest has waited)."""
        rows, nbytes = self._unwritten()
        spooled = self.spool.waiting()
        return Waiting(rows + spooled.rows, spooled.seconds, nbytes + spooled.bytes)

    def spool_backlog(self) -> SpoolBacklog | None:
        """The bytes of this rank's tensor segments on disk that no store has taken yet (closed
        segments not yet ingested or replayed, and the native writer's open one) against
        ``spool_max_bytes``; None without a bound."""
        if self.spool_max_bytes is None:
            return None
        live = self._native_live() if self._native_live else None
        open_bytes = (live or {}).get("open_bytes", 0)
        return SpoolBacklog(self.spool.waiting().bytes + open_bytes, self.spool_max_bytes, self.spool.dir)

    def flush(self) -> None:
        """Write everything buffered, wait for the writers and make the spool durable (fsync)."""
        self._drain_buffers(records_only=False)

    def close(self) -> DMISinkReport:
        """Flush, write this rank's report segment, give up the rank folder; the report (once: later calls return it)."""
        with self._buf_lock:
            if self._closed:
                return self.report
        self.flush()
        with self._buf_lock:
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._fold_native()
        self._before_report()
        with self._io_lock:
            self._emit_meta("reports", report_table(self.run_id, self.attempt, self.coords.rank, self.report))
        self._after_close()
        release_rank_dir(self.spool.dir)
        if self.report.records_dropped:
            log.warning("DMI sink (rank %d): %s", self.coords.rank, self.report.summary())
        return self.report

    # -- internals --------------------------------------------------------------------------
    def _fold_native(self) -> None:
        """The native writer's final counts join the report (once, at close)."""
        n, self._native = self._native, {}
        if not n:
            return
        with self._buf_lock:
            self.report.records_written += n["records"]
            self.report.bytes_written += n["bytes"]
            self.report.records_dropped += n["dropped_records"]
            self.report.bytes_dropped += n["dropped_bytes"]
            self.report.errors.extend(n["errors"])  # the drain logged each when it happened

    def _before_report(self) -> None:
        """What a subclass does once everything is written, before this rank's report segment (StoreSink ingests)."""

    def _after_close(self) -> None:
        """What a subclass does after the report segment (StoreSink finishes its ingester)."""

    def _drain_buffers(self, records_only: bool) -> None:
        with self._buf_lock:
            batch, rows, nbytes = self._buf, self._buf_rows, self._buf_bytes
            self._buf, self._buf_rows, self._buf_bytes = [], 0, 0
            drops = []
            if not records_only:
                drops, self._drops = self._drops, []
        if batch:
            table = pa.concat_tables(batch)
            if self.attempt == 0:
                self.attempt = int(pc.max(table.column("attempt")).as_py())
            self._submit_records(table, rows, nbytes)
        if not records_only:
            self._wait_writers()
            with self._io_lock:
                if drops:
                    self._emit_meta("drops", drops_table(drops))
                self._sync_spool()

    def _submit_records(self, table: pa.Table, n: int, nbytes: int) -> None:
        if self._pool is None:
            with self._io_lock:
                self._emit_records(table, n, nbytes)
            return
        self._slots.acquire()  # back-pressure: at most `writers` segments in flight
        fut = self._pool.submit(self._emit_records, table, n, nbytes)
        with self._buf_lock:
            self._inflight[fut] = (n, nbytes)
        fut.add_done_callback(lambda f: self._writer_done(f, n, nbytes))

    def _writer_done(self, fut: Future, n: int, nbytes: int) -> None:
        self._slots.release()
        exc = fut.exception()
        with self._buf_lock:
            self._inflight.pop(fut, None)
            if exc is not None:  # _emit_records handles OSError; anything else is a bug, but loses no count
                self.report.records_dropped += n
                self.report.bytes_dropped += nbytes
                self.report.errors.append(f"spool writer failed on {n} record(s): {exc!r}")
        if exc is not None:
            log.error("DMI rank %d: spool writer failed on %d record(s): %r", self.coords.rank, n, exc)

    def _wait_writers(self) -> None:
        with self._buf_lock:
            pending = list(self._inflight)
        wait_futures(pending)

    def _sync_spool(self) -> None:
        try:
            self.spool.sync()
        except OSError as e:
            self._error(f"DMI rank {self.coords.rank}: fsync of the spool in {self.spool.dir} failed: {e}")

    def _spool(self, kind: str, table: pa.Table, durable: bool = True) -> bool:
        """Write a segment; on a full or failing disk warn loudly and return False."""
        try:
            self.spool.write(kind, table, durable=durable)
            return True
        except OSError as e:
            what = "disk full" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
            msg = (
                f"DMI rank {self.coords.rank}: cannot write a {kind} spool segment of {table.num_rows} rows "
                f"to {self.spool.dir} ({what}); those rows are DROPPED"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.error(msg)
            self._error(msg)
            return False

    def _emit_records(self, table, n, nbytes):
        ok = self._spool("tensors", table, durable=False)
        with self._buf_lock:
            if ok:
                self.report.records_written += n
                self.report.bytes_written += nbytes
            else:
                self.report.records_dropped += n
                self.report.bytes_dropped += nbytes

    def _emit_meta(self, kind, table):
        self._spool(kind, table)

    def native_spool_target(self) -> dict | None:
        """The spool folder's native target for ``segment_bytes`` segments, closed after ``segment_seconds``."""
        return dict(self.spool.native_target(self.segment_bytes), segment_seconds=self.segment_seconds)

    def native_started(self, live_stats) -> None:
        """Keep ``live_stats`` to read the native writer's live counters."""
        self._native_live = live_stats

    def native_progress(self, stats: dict, closed: list[tuple[str, int]]) -> None:
        """Adopt the segments the native writer closed into the spool, and keep its latest counters."""
        for path, rows in closed:
            self.spool.adopt(path, rows)
        with self._buf_lock:
            self._native = stats


class StoreSink(SpoolSink):
    """``--dmi-persist clickhouse``: every rank spools; the node's ingester, a process of its own that local rank 0
    starts and supervises (store/ingester.py), loads all ranks' segments into the store: the embedded chDB store
    ``<store_dir>/chdb``, or the ClickHouse server at ``url``. ``close()`` on local rank 0 asks it for the final
    pass and waits, so close every other rank first (the training integration barriers before rank 0's close)."""

    def __init__(
        self,
        store_dir: str,
        run_id: str,
        coords: ParallelCoords,
        is_ingester: bool,
        database: str = S.DEFAULT_DATABASE,
        ingest_poll_s: float = 2.0,
        ingest_threads: int | None = None,
        ingest_nice: int = 10,
        codec: str | None = None,
        url: str | None = None,
        password: str | None = None,
        **kw,
    ):
        """Spool under ``<store_dir>/spool``; on the node's ingesting rank (``is_ingester``) also start the
        ingester process (a pass every ``ingest_poll_s`` s or when a segment closes, at ``ingest_nice`` lower CPU
        priority) into the embedded store with ``ingest_threads`` chDB threads or, with ``url``, into that server
        with ``ingest_threads`` parallel inserts (``password``: the server's); a store it creates gets payload
        codec ``codec``."""
        self.name = "clickhouse" if url else "chdb"
        super().__init__(run_id, coords, os.path.join(store_dir, "spool"), **kw)
        self.store_dir = store_dir
        self.url = url
        self.is_ingester = is_ingester
        self.ingester: IngesterProcess | None = None
        if is_ingester:
            self.ingester = IngesterProcess(
                store_dir,
                database,
                poll_s=ingest_poll_s,
                threads=ingest_threads,
                nice=ingest_nice,
                codec=codec,
                url=url,
                password=password,
            ).start()

    def _emit_records(self, table, n, nbytes):
        super()._emit_records(table, n, nbytes)
        if self.ingester is not None:
            self.ingester.wake()

    def native_progress(self, stats: dict, closed: list[tuple[str, int]]) -> None:
        """As the spool sink does, then wake the ingester when segments were closed."""
        super().native_progress(stats, closed)
        if closed and self.ingester is not None:
            self.ingester.wake()

    def store_lag(self) -> Waiting:
        """Buffered records plus this rank's segments the ingester has not loaded yet."""
        return self._store_lag()

    def _before_report(self) -> None:
        # Ingest everything (all ranks closed) before our own report, so its counts are final.
        if self.ingester is None:
            return
        close_began = time.time()
        r = self.ingester.sync()
        with self._buf_lock:
            self.report.segments_ingested = r.segments_loaded
            self.report.segments_corrupt = r.segments_corrupt
            for e in r.errors:
                if e not in self.report.errors:
                    self.report.errors.append(e)
        status = self.ingester.status
        if status is not None and status.owner and status.complete_at:
            self.report.store_complete_s = max(0.0, status.complete_at - close_began)
        self._settle_written()

    def _store_view(self, passed_after: float = 0.0) -> tuple[dict, set[str], str]:
        """What the store's ingester read back, per (run, attempt, spool rank), the ids of segments it
        verified but has not retired, and who that ingester is: ours, or the process that holds the store
        (its status file). With ``passed_after`` (a ``time.time()``), first wait, while it runs and at most
        60 s, for it to publish a pass that ended after then."""
        deadline = time.monotonic() + 60
        while True:
            if self.ingester.owner:
                status, running = self.ingester.status, self.ingester.alive()
                view = self.ingester.result.verified, self.ingester.credited, "this run's ingester"
            else:
                status = read_status(self.store_dir)
                running = live_ingester(self.store_dir) is not None
                if status is None or not status.owner:
                    return {}, set(), "no ingester (the store is held by another process)"
                r = IngestResult.from_dict(status.result)
                view = r.verified, set(status.credited_waiting), f"the ingester holding the store (pid {status.pid})"
            if status is None or status.last_pass > passed_after or not running or time.monotonic() > deadline:
                return view
            time.sleep(0.05)

    def _waiting_in_spool(self) -> list[tuple[str, int, int]]:
        """(segment id, rows, bytes) of this rank's records of this attempt in each tensor segment left in its spool
        folder (a corrupt one's were reported by the ingester; one that vanished meanwhile was loaded)."""
        from megatron.core.dmi.store.segments import CorruptSegmentError, list_segments, peek_segment_id, verify_segment

        out = []
        for seg in list_segments(self.spool_root, ranks={self.coords.rank}):
            if seg.kind != "tensors":
                continue
            try:
                sid = peek_segment_id(seg)
                t = verify_segment(seg).table
            except (CorruptSegmentError, OSError):
                continue
            t = t.filter(
                pc.and_(pc.equal(t.column("run_id"), self.run_id), pc.equal(t.column("attempt"), self.attempt))
            )
            out.append((sid, t.num_rows, table_nbytes(t)))
        return out

    def _settle_written(self) -> None:
        """``written`` becomes what the store's ingester read back from the store for this rank's records
        of this attempt. Of the rest, what still lies readable in our spool folder is ``spooled``
        (a reader, ``load`` or ``megatron-dmi ingest`` picks it up); anything else (quarantined as corrupt,
        or a segment that vanished) is ``dropped``, with an error saying so."""
        # The spool first, then what the ingester says: a segment it loads in between counts twice, which the
        # limits below absorb; one it retired before the listing in a pass not yet published would count as
        # lost, so a loss is only believed once a pass that ended after the listing is published.
        mine = (self.run_id, self.attempt, self.coords.rank)
        listed_at = time.time()
        waiting = self._waiting_in_spool()

        def split(passed_after: float = 0.0) -> tuple[int, int, int, int, str]:
            verified, credited, who = self._store_view(passed_after)
            stored, stored_bytes = verified.get(mine, (0, 0))
            left = [(n, b) for sid, n, b in waiting if sid not in credited]  # credited: in the store already
            return stored, stored_bytes, sum(n for n, _ in left), sum(b for _, b in left), who

        stored, stored_bytes, left_rows, left_bytes, who = split()
        with self._buf_lock:
            unaccounted = stored + left_rows < self.report.records_written
        if unaccounted:
            stored, stored_bytes, left_rows, left_bytes, who = split(passed_after=listed_at)
        with self._buf_lock:
            rep = self.report
            stored, stored_bytes = min(stored, rep.records_written), min(stored_bytes, rep.bytes_written)
            left_rows = min(left_rows, rep.records_written - stored)
            lost = rep.records_written - stored - left_rows
            lost_bytes = max(0, rep.bytes_written - stored_bytes - left_bytes)
            rep.records_written, rep.bytes_written = stored, stored_bytes
            rep.records_spooled += left_rows
            rep.bytes_spooled += left_bytes
            rep.records_dropped += lost
            rep.bytes_dropped += lost_bytes
            if lost:
                rep.errors.append(
                    f"{lost} record(s) this rank spooled are neither in the store nor in the spool "
                    f"(quarantined as corrupt, or their segment vanished): see dmi.quarantine and "
                    f"dmi.segments"
                )
            if left_rows:
                rep.spooled_note = f"waiting in {self.spool.dir} for {who}; {self.loads_the_spool()} loads them"
        if left_rows:
            log.warning(
                "DMI rank %d: %d record(s) are not in the store yet; they wait in %s for %s (%s loads them)",
                self.coords.rank,
                left_rows,
                self.spool.dir,
                who,
                self.loads_the_spool(),
            )

    def loads_the_spool(self) -> str:
        """The commands that load what this store's spool holds, for a message."""
        if self.url:
            return (
                f"`megatron-dmi ingest {self.store_dir} --clickhouse-url {self.url}` or "
                f"`megatron-dmi load {self.store_dir} --store {self.url}`"
            )
        return f"`megatron-dmi ingest {self.store_dir}` or opening the store"

    def _after_close(self) -> None:
        if self.ingester is not None:
            self.ingester.finish()  # loads our report segment too, then closes the store
            self.ingester = None
