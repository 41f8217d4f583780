"""Loading data into a store: the one code path shared by the ingester, ``load``, the reader's
crash recovery, spool replay into a server, and direct server inserts.

``load_table`` inserts one Arrow table of a spool kind (deriving the summary tables from tensor
records); ``ingest_spool`` loads every complete spool segment not yet ingested, idempotently:
tables are ReplacingMergeTree keyed on the full record key, and the ``segments`` table remembers
which segment ids are in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatron.core.dmi.errors import DMIError, InvalidArgumentError
from megatron.core.dmi.store import raw_segment
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store.backend import Backend
from megatron.core.dmi.store.raw_segment import CorruptSegmentError, VerifiedSegment
from megatron.core.dmi.store.segments import Segment, list_segments, peek_segment_id, verify_segment

log = logging.getLogger("megatron.core.dmi.sinks")

EXPERT_COUNTS_OUTPUT = "router.expert_counts"

# Test-only (tests/fault_tests/test_ingester_process.py): ``DMI_TEST_CRASH_AT=<point>:<kind>`` kills the
# process at that point of loading a batch of that spool kind, as ``kill -9`` would. Never set in real runs.
TEST_CRASH_ENV = "DMI_TEST_CRASH_AT"
TEST_CRASH_POINTS = ("during_insert", "mid_insert", "after_insert", "after_read_back", "after_record", "mid_retire")


def _test_crash_point(point: str, kind: str) -> None:
    """SIGKILL this process here when ``$DMI_TEST_CRASH_AT`` is ``<point>:<kind>`` (test-only; see
    TEST_CRASH_ENV). ``during_insert`` kills from another thread 5 ms into the insert that follows (chDB
    releases the GIL while it writes), so the kill lands inside chDB's write or, for a quick one, just after."""
    if os.environ.get(TEST_CRASH_ENV) != f"{point}:{kind}":
        return
    if point == "during_insert":
        threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def derive_expert_counts(tensors: pa.Table) -> pa.Table:
    """One row per (record, expert) from ``router.expert_counts`` records ([2, E] int32:
    row 0 tokens before capacity dropping, row 1 after)."""
    mask = pc.equal(tensors.column("output"), EXPERT_COUNTS_OUTPUT)
    sub = tensors.filter(mask)
    cols: dict[str, list] = {n: [] for n in S.EXPERT_COUNTS_SCHEMA.names}
    if sub.num_rows:
        keep = list(S.EXPERT_COUNT_KEYS)
        rows = sub.select(keep + ["dtype", "shape", "payload"]).to_pylist()
        for row in rows:
            shape = row["shape"]
            if row["dtype"] not in ("int32", "int64") or len(shape) != 2 or shape[0] != 2:
                log.warning(
                    "DMI: skipping malformed router.expert_counts record (dtype %s, shape %s)", row["dtype"], shape
                )
                continue
            counts = np.frombuffer(row["payload"], dtype=np.int32 if row["dtype"] == "int32" else np.int64).reshape(
                2, -1
            )
            n = counts.shape[1]
            for k in keep:
                cols[k].extend([row[k]] * n)
            cols["expert"].extend(range(n))
            cols["tokens_pre"].extend(counts[0].tolist())
            cols["tokens_post"].extend(counts[1].tolist())
    return pa.Table.from_pydict(cols, schema=S.EXPERT_COUNTS_SCHEMA)


def load_table(backend: Backend, kind: str, table: pa.Table) -> list[tuple[str, pa.Table]]:
    """Insert one table of a spool kind (plus its derived summary rows); returns what went into
    which table, for ``rows_missing``."""
    if table.num_rows == 0:
        return []
    table = table.replace_schema_metadata(None)
    backend.insert_arrow(kind, table)
    inserted = [(kind, table)]
    if kind == "tensors":
        ec = derive_expert_counts(table)
        if ec.num_rows:
            _test_crash_point("mid_insert", kind)  # the records are in, their derived rows not
            backend.insert_arrow("expert_counts", ec)
            inserted.append(("expert_counts", ec))
    return inserted


def rows_missing(backend: Backend, table_name: str, table: pa.Table) -> np.ndarray:
    """Read back what was just inserted: True for each row of ``table`` that ``table_name`` does
    not hold with the same key (and payload checksum). Only key columns travel, never payloads;
    the scan is narrowed to the batch's runs, iterations and ranks. Why: chDB can return from an
    insert without an error and store nothing (seen below ~1 MiB free)."""
    cols = list(S.ORDER_BY[table_name]) + (["checksum"] if "checksum" in table.schema.names else [])
    mine = table.select(cols)
    where, params = [], {}
    if "run_id" in cols:
        where.append("run_id IN {runs:Array(String)}")
        params["runs"] = pc.unique(mine.column("run_id")).to_pylist()
    if "iteration" in cols:
        lo, hi = pc.min_max(mine.column("iteration")).values()
        where.append("iteration BETWEEN {lo:Int64} AND {hi:Int64}")
        params.update(lo=lo.as_py(), hi=hi.as_py())
    if "rank" in cols:
        where.append("rank IN {ranks:Array(Int32)}")
        params["ranks"] = pc.unique(mine.column("rank")).to_pylist()
    sql = f"SELECT DISTINCT {', '.join(cols)} FROM {backend.t(table_name)}"
    stored = backend.query_arrow(sql + (" WHERE " + " AND ".join(where) if where else ""), params)
    stored = stored.select(cols).cast(mine.schema.remove_metadata())
    rows = mine.append_column("__row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    absent = rows.join(stored, keys=cols, join_type="left anti").column("__row").to_numpy()
    missing = np.zeros(table.num_rows, dtype=bool)
    missing[absent] = True
    return missing


MIN_FREE_ENV = "DMI_STORE_MIN_FREE_MB"
DEFAULT_MIN_FREE_MB = 16.0


class MinFreeSpaceError(DMIError, ValueError):
    """``$DMI_STORE_MIN_FREE_MB`` is not a number of MiB >= 0."""


def min_free_bytes() -> int:
    """Free space the embedded store's file system must keep for ingest to run (a chDB insert
    into a nearly full disk can vanish without an error): ``$DMI_STORE_MIN_FREE_MB``, default 16."""
    raw = os.environ.get(MIN_FREE_ENV, str(DEFAULT_MIN_FREE_MB))
    try:
        mb = float(raw)
        if not mb >= 0:
            raise ValueError
    except ValueError:
        raise MinFreeSpaceError(f"{MIN_FREE_ENV}={raw!r}: expected a number of MiB >= 0") from None
    return int(mb * 2**20)


STAGES = ("verify", "insert", "read_back", "record")


@dataclass
class IngestResult:
    """What an ingest pass did with each spool segment, and how many records it loaded."""

    segments_loaded: int = 0  # every record verified in the store (``partial`` ones included)
    segments_skipped: int = 0  # already ingested
    segments_corrupt: int = 0  # nothing in them could be loaded
    segments_partial: int = 0  # loaded, with some records quarantined
    segments_unverified: int = 0  # insert refused, or not read back whole: left in the spool for the next pass
    records_quarantined: int = 0
    rows: int = 0  # rows of every kind
    records: int = 0  # tensor records
    payload_bytes: int = 0
    paused: str = ""  # why ingest is paused ("" when it is not)
    missing_segments: set[str] = field(default_factory=set)  # raw segments absent from a writer's run of numbers
    # (run_id, attempt, rank of the spool folder) -> [records, payload bytes] verified in the store
    verified: dict[tuple[str, int, int], list[int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # Wall seconds by stage: waiting for segments to be read and verified (the reading thread works while
    # batches are inserted), inserting batches, reading them back (both summed over the insert streams),
    # recording and retiring segments (benchmarks/ingest_throughput.py reports the read-back's share).
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    def add(self, other: IngestResult) -> None:
        """Add another pass's counts, missing segments, verified totals and new errors to these; its ``paused``
        replaces ours."""
        for name in (
            "segments_loaded",
            "segments_skipped",
            "segments_corrupt",
            "segments_partial",
            "segments_unverified",
            "records_quarantined",
            "rows",
            "records",
            "payload_bytes",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.paused = other.paused
        self.missing_segments |= other.missing_segments
        for k, (n, b) in other.verified.items():
            mine = self.verified.setdefault(k, [0, 0])
            mine[0] += n
            mine[1] += b
        self.errors.extend(e for e in other.errors if e not in self.errors)  # a stuck segment: said once
        for stage, s in other.seconds.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + s

    def to_dict(self) -> dict:
        """Plain JSON types (the ingester process sends its result as JSON)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["missing_segments"] = sorted(self.missing_segments)
        d["verified"] = [[run, attempt, rank, n, b] for (run, attempt, rank), (n, b) in self.verified.items()]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> IngestResult:
        """The result ``to_dict`` wrote."""
        d = dict(d)
        d["missing_segments"] = set(d.get("missing_segments", ()))
        d["verified"] = {(run, attempt, rank): [n, b] for run, attempt, rank, n, b in d.get("verified", ())}
        d["errors"] = list(d.get("errors", ()))
        return cls(**d)

    def note(self, msg: str, level: int = logging.ERROR) -> None:
        """Keep an error message once, logging it at ``level`` the first time."""
        if msg not in self.errors:
            self.errors.append(msg)
            log.log(level, "DMI: %s", msg)


def _now() -> datetime:
    return datetime.now(UTC)


def known_segment_ids(backend: Backend) -> set[str]:
    """Ids of the spool segments a store has already ingested."""
    t = backend.query_arrow(f"SELECT segment_id FROM {backend.t('segments')}")
    return set(t.column("segment_id").to_pylist())


@dataclass
class _Pending:
    seg: Segment
    sid: str
    table: pa.Table
    problems: str  # "" for a clean segment


def ingest_spool(
    backend: Backend,
    spool_root: str,
    *,
    ranks: set[int] | None = None,
    delete: bool = False,
    known: set[str] | None = None,
    credited: set[str] | None = None,
    max_batch_bytes: int = 256 << 20,
    streams: int = 1,
    readers: int | None = None,
    hold: set[str] | frozenset[str] = frozenset(),
    left: set[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> IngestResult:
    """Load every complete segment under ``spool_root`` that the store does not hold yet.

    Each segment is verified (every CRC and total, ``verify_segment``): what does not verify is
    quarantined (``dmi.quarantine``) and the rest loads; a segment with nothing loadable is
    reported, recorded and, when ``delete`` (the store owns the spool), renamed ``*.corrupt``.
    Segments are inserted in batches of up to ``max_batch_bytes`` per kind, and every batch is
    read back: only segments whose rows are all found in the store are recorded in
    ``dmi.segments`` and, with ``delete``, removed (a partly quarantined one is renamed
    ``*.corrupt`` instead); the others stay for the next pass. No batch is inserted while the
    store's file system has less than ``min_free_bytes()`` free. ``progress(n_bytes)`` is called as
    segments are consumed. A tensor segment's records count in ``IngestResult.verified`` once all
    of them are read back, even if its derived rows were not (it then stays for those), and only
    once per id in ``credited`` (pass the same set to every pass). Up to ``streams`` batches are inserted and
    read back at once, each on its own connection (a server's inserts are independent; the embedded store
    takes them one after the other), always on threads of their own, so that the next batch's segments are
    verified meanwhile; each is recorded and retired once it is read back, in the order taken. ``readers``
    threads (default: ``streams`` or the backend's ``insert_streams``, whichever is more) verify segments
    ahead, so that verifying keeps up with parallel inserts.
    Segments whose id is in ``hold`` are not taken (they stay in the spool); the ids of the segments this
    pass took and did not load (refused, not read back whole, ingest paused) are added to ``left``.
    """
    if streams < 1:
        raise InvalidArgumentError(f"streams must be >= 1, not {streams}")
    if readers is None:
        readers = max(streams, backend.insert_streams)
    if readers < 1:
        raise InvalidArgumentError(f"readers must be >= 1, not {readers}")
    if known is None:
        known = known_segment_ids(backend)
    ingest = _IngestPass(
        backend,
        spool_root,
        delete=delete,
        known=known,
        credited=set() if credited is None else credited,
        max_batch_bytes=max_batch_bytes,
        streams=streams,
        readers=readers,
        hold=hold,
    )
    if ingest.too_full():  # not even worth reading the segments
        ingest.res.note(ingest.res.paused)
        return ingest.res
    try:
        return ingest.run(list_segments(spool_root, ranks), progress)
    finally:
        if left is not None:
            left |= ingest.taken - ingest.retired


class _IngestPass:
    """One pass of ``ingest_spool``: its result, the segment ids it skips and credits, the verified
    segments queued per kind until their batch is committed, and the batches being inserted."""

    def __init__(
        self,
        backend: Backend,
        spool_root: str,
        *,
        delete: bool,
        known: set[str],
        credited: set[str],
        max_batch_bytes: int,
        streams: int,
        readers: int,
        hold: set[str] | frozenset[str],
    ):
        self.backend = backend
        self.spool_root = spool_root
        self.delete = delete
        self.known = known
        self.credited = credited
        self.max_batch_bytes = max_batch_bytes
        self.min_free = min_free_bytes()
        self.res = IngestResult()
        self.pending: dict[str, list[_Pending]] = {}
        self.pending_bytes: dict[str, int] = {}
        self.numbering: dict[str, tuple[int, int, set[int]]] = {}  # raw writer -> (first seq, rank, seqs seen)
        self.streams = streams
        self.readers = readers
        self.inserting: ThreadPoolExecutor | None = None  # the insert streams, while ``run`` runs
        self.in_flight: deque[tuple[str, list[_Pending], pa.Table, Future]] = deque()  # in the order taken
        self.seconds_lock = threading.Lock()  # the streams time their stages too
        self.hold = hold
        self.taken: set[str] = set()  # ids of the segments queued for a batch
        self.retired: set[str] = set()  # ... and of those loaded

    def too_full(self) -> bool:
        """Whether ingest is paused: the store's file system is below the free-space margin."""
        free = self.backend.free_bytes()
        if free is not None and free < self.min_free:
            self.res.paused = (
                f"ingest paused: the store's file system has {free / 2**20:.1f} MiB free, below the "
                f"{self.min_free / 2**20:.0f} MiB margin (${MIN_FREE_ENV}); segments wait in the spool"
            )
        return bool(self.res.paused)

    def run(self, segments: list[Segment], progress: Callable[[int], None] | None) -> IngestResult:
        """Take every segment, commit what is still queued, then look for missing raw segments."""
        raw_on_disk = {(s.rank, s.seq) for s in segments if s.raw}  # damaged ones too: those are not missing
        # Reading threads verify the next segments while this one is queued and batches are inserted on the
        # insert streams: reading (pyarrow, zlib) and inserting (chDB, or a server's HTTP request) both release
        # the GIL, so they overlap. ``readers + 1`` segments ahead bound what is held in memory (raw segments
        # are memory-mapped); everything else (skip, queue, commit, settle, retire) stays here, in order.
        window = self.readers + 1
        with (
            ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="dmi-ingest-read") as reader,
            ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="dmi-ingest-stream") as streams,
        ):
            self.inserting = streams
            ahead = deque(reader.submit(self.read_ahead, s) for s in segments[:window])
            for i, seg in enumerate(segments):
                if i + window < len(segments):
                    ahead.append(reader.submit(self.read_ahead, segments[i + window]))
                size = seg.size
                self.take(seg, ahead.popleft())
                if progress:
                    progress(size)
            for kind in list(self.pending):
                self.commit(kind)
            while self.in_flight:
                self.settle(*self.in_flight.popleft())
        _check_numbering(self.backend, self.numbering, raw_on_disk, self.res)
        if self.res.paused:
            self.res.note(self.res.paused)
        return self.res

    def read_ahead(self, seg: Segment) -> VerifiedSegment | None:
        """The reading thread's work: ``verify_segment(seg)``, or None for a segment the store holds already or
        that is held back."""
        sid = peek_segment_id(seg)
        if sid in self.known or sid in self.hold:
            return None
        return verify_segment(seg)

    def take(self, seg: Segment, read: Future | None = None) -> None:
        """Skip a segment the store holds, leave one held back, reject one that cannot be read, else queue it
        verified (by ``read``, the reading thread's ``read_ahead``, or here)."""
        try:
            sid = peek_segment_id(seg)
            if seg.raw:
                writer, seq, first = raw_segment.numbering(seg.path)
                self.numbering.setdefault(writer, (first, seg.rank, set()))[2].add(seq)
            if sid in self.known:
                self.res.segments_skipped += 1
                if self.delete:
                    _retire(seg, keep=False)
                return
            if sid in self.hold:
                return
            with self.timed("verify"):
                verified = read.result() if read is not None else None
                if verified is None:
                    verified = verify_segment(seg)
        except Exception as e:  # last resort: whatever is wrong with one segment, the ones behind it still load
            self.reject(seg, e)
            return
        self.queue(seg, sid, verified)

    def reject(self, seg: Segment, error: Exception) -> None:
        """A segment with nothing readable: reported, recorded in ``dmi.segments``, kept as ``*.corrupt``."""
        if isinstance(error, (CorruptSegmentError, OSError)):
            msg = str(error)
        else:
            msg = f"{seg.path}: {type(error).__name__}: {error}"
        self.res.segments_corrupt += 1
        self.res.note(f"corrupt spool segment skipped: {msg}")
        _record_corrupt(self.backend, seg, self.spool_root, msg)
        if self.delete:
            _retire(seg, keep=True)

    def queue(self, seg: Segment, sid: str, v: VerifiedSegment) -> None:
        """Quarantine what did not verify and queue the rest for its kind's batch (committed once full)."""
        problems = "" if v.clean else v.summary(seg.path)
        if problems:
            self.res.records_quarantined += sum(q.row >= 0 for q in v.quarantined)
            self.res.note(f"spool segment failed verification: {problems}")
            _record_quarantine(self.backend, seg, sid, self.spool_root, v)
        if v.table.num_rows == 0:
            self.res.segments_corrupt += 1
            _record_corrupt(self.backend, seg, self.spool_root, problems, sid)
            self.known.add(sid)
            if self.delete:
                _retire(seg, keep=True)
            return
        self.pending.setdefault(seg.kind, []).append(_Pending(seg, sid, v.table, problems))
        self.taken.add(sid)
        self.pending_bytes[seg.kind] = self.pending_bytes.get(seg.kind, 0) + v.table.nbytes
        if self.pending_bytes[seg.kind] >= self.max_batch_bytes:
            self.commit(seg.kind)

    def commit(self, kind: str) -> None:
        """Insert a kind's queued batch and read it back (on an insert stream when there are several, waiting
        for the oldest batch in flight when all are busy), then settle it."""
        batch = self.pending.pop(kind, [])
        self.pending_bytes.pop(kind, None)
        if not batch or self.too_full():
            return
        tables = [p.table for p in batch]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        while len(self.in_flight) >= self.streams:
            self.settle(*self.in_flight.popleft())
        self.in_flight.append((kind, batch, table, self.inserting.submit(self.insert, kind, table)))

    def settle(self, kind: str, batch: list[_Pending], table: pa.Table, inserted) -> None:
        """Credit what a batch's read-back found, and record and retire the segments fully stored; ``inserted``
        is what ``insert`` returned, or the future of it."""
        if isinstance(inserted, Future):
            inserted = inserted.result()
        missing, derived_missing, refused = inserted
        self.credit(kind, batch, missing)
        _test_crash_point("after_read_back", kind)
        if refused is not None:
            self.res.segments_unverified += len(batch)
            landed = int((~missing).sum())
            self.res.note(
                f"insert of {len(batch)} spool segment(s) ({table.num_rows} rows) failed: {refused}; "
                + (f"{landed} of the rows are in the store nevertheless (read back); " if landed else "")
                + "they stay in the spool and are retried"
            )
            return
        done = self.fully_stored(batch, missing, derived_missing)
        with self.timed("record"):
            if done and self.record_loaded(kind, done):
                _test_crash_point("after_record", kind)
                self.retire_loaded(kind, done)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall time of the block to ``res.seconds[stage]`` (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self.seconds_lock:
                self.res.seconds[stage] += time.perf_counter() - t0

    def insert(self, kind: str, table: pa.Table) -> tuple[np.ndarray, int, Exception | None]:
        """Insert a batch (and its derived rows) and read it back: the batch's rows not found, the
        derived rows not found, and the error that refused the insert or the read-back (or None). Runs on
        an insert stream: it touches nothing of the pass but its stage times."""
        refused = None
        try:
            with self.timed("insert"):
                _test_crash_point("during_insert", kind)
                loaded = load_table(self.backend, kind, table)
            _test_crash_point("after_insert", kind)
        except Exception as exc:  # the store refused the batch (disk full, server error), but an insert can
            # fail after storing some or all of its rows (seen on a full disk): the read-back below decides
            refused = exc
            loaded = [(kind, table)]
        missing = np.ones(table.num_rows, dtype=bool)
        derived_missing = 0
        try:
            with self.timed("read_back"):
                found = [(name, rows_missing(self.backend, name, t)) for name, t in loaded]
            for name, m in found:
                if name == kind:
                    missing = m
                else:
                    derived_missing += int(m.sum())
        except Exception as exc:  # cannot read back (any store error): nothing of the batch counts
            refused = refused or exc
            missing[:] = True
        return missing, derived_missing, refused

    def credit(self, kind: str, batch: list[_Pending], missing: np.ndarray) -> None:
        """Count the records of each tensor segment whose rows were all read back, once per segment."""
        if kind != "tensors":
            return
        start = 0
        for p in batch:
            n = p.table.num_rows
            if not missing[start : start + n].any() and p.sid not in self.credited:
                self.credited.add(p.sid)
                _count_verified(self.res, p.table, p.seg.rank)
            start += n

    def fully_stored(self, batch: list[_Pending], missing: np.ndarray, derived_missing: int) -> list[_Pending]:
        """The segments of a batch whose rows (and the batch's derived rows) are all in the store;
        each other one is reported and stays in the spool."""
        done: list[_Pending] = []
        start = 0
        for p in batch:
            n = p.table.num_rows
            lost = int(missing[start : start + n].sum())
            start += n
            if not (lost or derived_missing):
                done.append(p)
                continue
            self.res.segments_unverified += 1
            what = (
                f"{lost} of {n} row(s)"
                if lost
                else f"{derived_missing} derived row(s) of its batch (its own {n} are in)"
            )
            self.res.note(
                f"{p.seg.path}: {what} not found in the store after the insert; the segment stays in "
                f"the spool and is retried"
            )
        return done

    def record_loaded(self, kind: str, done: list[_Pending]) -> bool:
        """Record loaded segments in ``dmi.segments``; False (reported) when the store refuses."""
        now = _now()
        rows = {
            "segment_id": [p.sid for p in done],
            "path": [os.path.relpath(p.seg.path, self.spool_root) for p in done],
            "kind": [kind] * len(done),
            "rank": [p.seg.rank for p in done],
            "rows": [p.table.num_rows for p in done],
            "bytes": [p.seg.size for p in done],
            "status": ["partial" if p.problems else "ok" for p in done],
            "error": [p.problems[:2000] for p in done],
            "ingested_at": [now] * len(done),
        }
        try:
            self.backend.insert_arrow("segments", pa.Table.from_pydict(rows, schema=S.SEGMENTS_SCHEMA))
        except Exception as exc:  # the records are in the store (read back and credited); only the
            # bookkeeping row is not: keep the segments, the next pass loads them again (no duplicates)
            self.res.note(
                f"recording {len(done)} loaded spool segment(s) in {S.qualified(self.backend.database, 'segments')} "
                f"failed: {exc}; their records are in the store, the segments stay in the spool and are retried"
            )
            return False
        return True

    def retire_loaded(self, kind: str, done: list[_Pending]) -> None:
        """Count recorded segments as loaded and, when the store owns the spool, retire them."""
        for p in done:
            self.known.add(p.sid)
            self.retired.add(p.sid)
            self.res.segments_loaded += 1
            self.res.segments_partial += bool(p.problems)
            self.res.rows += p.table.num_rows
            if kind == "tensors":
                self.res.records += p.table.num_rows
                self.res.payload_bytes += int(pc.sum(p.table.column("nbytes")).as_py() or 0)
            if self.delete:
                _retire(p.seg, keep=bool(p.problems))
                _test_crash_point("mid_retire", kind)  # one segment of the batch deleted, the others not


def _count_verified(res: IngestResult, table: pa.Table, rank: int) -> None:
    """Credit a verified segment's records to the rank whose folder it came from (its writer)."""
    by = table.group_by(["run_id", "attempt"]).aggregate([("nbytes", "sum"), ("nbytes", "count")])
    for run, attempt, nbytes, n in zip(
        *(by.column(c).to_pylist() for c in ("run_id", "attempt", "nbytes_sum", "nbytes_count"))
    ):
        mine = res.verified.setdefault((run, attempt, rank), [0, 0])
        mine[0] += n
        mine[1] += nbytes or 0


def _retire(seg: Segment, keep: bool) -> None:
    """A consumed segment leaves the spool: deleted, or renamed ``*.corrupt`` when part of it
    did not verify (its bytes stay for inspection; nothing reads that name)."""
    try:
        if keep:
            os.rename(seg.path, seg.path + ".corrupt")
        else:
            os.unlink(seg.path)
    except OSError:
        pass


def _check_numbering(backend: Backend, numbering: dict, on_disk: set[tuple[int, int]], res: IngestResult) -> None:
    """A raw writer numbers its segments without gaps from ``first_seq``: a number neither in the
    spool nor in ``dmi.segments`` is a segment that went missing (deleted before it was loaded).
    A missing last segment cannot be told apart from one never written."""
    for writer, (first, rank, seen) in numbering.items():
        have = set(seen) | {seq for r, seq in on_disk if r == rank}
        t = backend.query_arrow(
            f"SELECT segment_id FROM {backend.t('segments')} WHERE startsWith(segment_id, {{w:String}})",
            {"w": writer + "-"},
        )
        have.update(n for _, n in filter(None, map(raw_segment.writer_of, t.column("segment_id").to_pylist())))
        gone = sorted(set(range(first, max(have) + 1)) - have)
        if gone:
            names = {f"rank-{rank:05d}/{n:08d}.dmiraw" for n in gone}
            res.missing_segments |= names
            res.note(
                f"spool segment(s) {', '.join(sorted(names))} of writer {writer} are missing: deleted "
                f"before they were loaded? Their records are lost"
            )


def _record_quarantine(backend: Backend, seg: Segment, sid: str, spool_root: str, v: VerifiedSegment) -> None:
    now = _now()
    rows = [
        {
            "segment_id": sid,
            "path": os.path.relpath(seg.path, spool_root),
            "rank": seg.rank,
            "row": q.row,
            "run_id": str(q.key.get("run_id", "")),
            "phase": str(q.key.get("phase", "")),
            "iteration": int(q.key.get("iteration", -1)),
            "attempt": int(q.key.get("attempt", -1)),
            "key_json": json.dumps(q.key, sort_keys=True, default=str),
            "reason": q.reason,
            "quarantined_at": now,
        }
        for q in v.quarantined
    ]
    if not v.quarantined:
        rows = [
            {
                "segment_id": sid,
                "path": os.path.relpath(seg.path, spool_root),
                "rank": seg.rank,
                "row": -1,
                "run_id": "",
                "phase": "",
                "iteration": -1,
                "attempt": -1,
                "key_json": "{}",
                "reason": "; ".join(v.problems),
                "quarantined_at": now,
            }
        ]
    try:
        backend.insert_arrow("quarantine", pa.Table.from_pylist(rows, schema=S.QUARANTINE_SCHEMA))
    except Exception as e:  # bookkeeping only: the error is in the result already
        log.warning("DMI: could not record quarantined records of %s: %s", seg.path, e)


def _record_corrupt(backend: Backend, seg: Segment, spool_root: str, msg: str, sid: str | None = None) -> None:
    sid = sid or "corrupt:" + hashlib.sha1(f"{os.path.abspath(seg.path)}:{seg.size}".encode()).hexdigest()
    row = {
        "segment_id": [sid],
        "path": [os.path.relpath(seg.path, spool_root)],
        "kind": [seg.kind],
        "rank": [seg.rank],
        "rows": [0],
        "bytes": [seg.size],
        "status": ["corrupt"],
        "error": [msg[:2000]],
        "ingested_at": [_now()],
    }
    try:
        backend.insert_arrow("segments", pa.Table.from_pydict(row, schema=S.SEGMENTS_SCHEMA))
    except Exception as e:  # bookkeeping only
        log.warning("DMI: could not record corrupt segment %s: %s", seg.path, e)
