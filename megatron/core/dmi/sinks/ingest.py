"""Loading data into a store: the one code path shared by the ingester, ``load``, the reader's
crash recovery, spool replay into a server, and direct server inserts.

``load_table`` inserts one Arrow table of a spool kind (deriving the summary tables from tensor
records); ``ingest_spool`` loads every complete spool segment not yet ingested, idempotently:
tables are ReplacingMergeTree keyed on the full record key, and the ``segments`` table remembers
which segment ids are in.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatron.core.dmi.sinks import schema as S
from megatron.core.dmi.sinks.backend import Backend, ChdbBackend, StoreBusyError
from megatron.core.dmi.sinks.spool import (
    CorruptSegmentError,
    Segment,
    list_segments,
    peek_segment_id,
    read_segment,
)

log = logging.getLogger("megatron.core.dmi.sinks")

EXPERT_COUNTS_OUTPUT = "router.expert_counts"


def derive_expert_counts(tensors: pa.Table) -> pa.Table:
    """One row per (record, expert) from ``router.expert_counts`` records ([2, E] int32:
    row 0 tokens before capacity dropping, row 1 after)."""
    mask = pc.equal(tensors.column("output"), EXPERT_COUNTS_OUTPUT)
    sub = tensors.filter(mask)
    cols: dict[str, list] = {n: [] for n in S.EXPERT_COUNTS_SCHEMA.names}
    if sub.num_rows:
        keep = ["run_id", "phase", "iteration", "attempt", "microbatch", "invocation", "layer", "rank", "dp",
                "token_start", "token_end", "token_total"]
        rows = sub.select(keep + ["dtype", "shape", "payload"]).to_pylist()
        for row in rows:
            shape = row["shape"]
            if row["dtype"] not in ("int32", "int64") or len(shape) != 2 or shape[0] != 2:
                log.warning("DMI: skipping malformed router.expert_counts record (dtype %s, shape %s)", row["dtype"], shape)
                continue
            counts = np.frombuffer(row["payload"], dtype=np.int32 if row["dtype"] == "int32" else np.int64).reshape(2, -1)
            n = counts.shape[1]
            for k in keep:
                cols[k].extend([row[k]] * n)
            cols["expert"].extend(range(n))
            cols["tokens_pre"].extend(counts[0].tolist())
            cols["tokens_post"].extend(counts[1].tolist())
    return pa.Table.from_pydict(cols, schema=S.EXPERT_COUNTS_SCHEMA)


def load_table(backend: Backend, kind: str, table: pa.Table) -> None:
    """Insert one table of a spool kind (plus its derived summary rows)."""
    if table.num_rows == 0:
        return
    table = table.replace_schema_metadata(None)
    backend.insert_arrow(kind, table)
    if kind == "tensors":
        ec = derive_expert_counts(table)
        if ec.num_rows:
            backend.insert_arrow("expert_counts", ec)


@dataclass
class IngestResult:
    segments_loaded: int = 0
    segments_skipped: int = 0  # already ingested
    segments_corrupt: int = 0
    rows: int = 0  # rows of every kind
    records: int = 0  # tensor records
    payload_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: "IngestResult") -> None:
        self.segments_loaded += other.segments_loaded
        self.segments_skipped += other.segments_skipped
        self.segments_corrupt += other.segments_corrupt
        self.rows += other.rows
        self.records += other.records
        self.payload_bytes += other.payload_bytes
        self.errors.extend(other.errors)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def known_segment_ids(backend: Backend) -> set[str]:
    t = backend.query_arrow(f"SELECT segment_id FROM {backend.t('segments')} WHERE status = 'ok'")
    return set(t.column("segment_id").to_pylist())


def ingest_spool(
    backend: Backend,
    spool_root: str,
    *,
    ranks: set[int] | None = None,
    delete: bool = False,
    known: set[str] | None = None,
    max_batch_bytes: int = 256 << 20,
    progress: Callable[[int], None] | None = None,
) -> IngestResult:
    """Load every complete segment under ``spool_root`` that the store does not hold yet.

    Segments are read and validated one by one (a corrupt or truncated segment is reported,
    renamed ``*.corrupt`` when ``delete`` (the store owns the spool) and skipped; the rest load),
    then inserted in batches of up to ``max_batch_bytes`` per kind. Only after a batch is in are
    its segment ids recorded and, with ``delete``, its files removed. ``progress(n_bytes)`` is
    called as segments are consumed.
    """
    res = IngestResult()
    if known is None:
        known = known_segment_ids(backend)
    segments = list_segments(spool_root, ranks)
    pending: dict[str, list[tuple[Segment, str, pa.Table]]] = {}
    pending_bytes: dict[str, int] = {}

    def commit(kind: str) -> None:
        batch = pending.pop(kind, [])
        pending_bytes.pop(kind, None)
        if not batch:
            return
        tables = [t for _, _, t in batch]
        load_table(backend, kind, pa.concat_tables(tables) if len(tables) > 1 else tables[0])
        now = _now()
        rows = {n: [] for n in S.SEGMENTS_SCHEMA.names}
        for seg, sid, t in batch:
            rows["segment_id"].append(sid)
            rows["path"].append(os.path.relpath(seg.path, spool_root))
            rows["kind"].append(kind)
            rows["rank"].append(seg.rank)
            rows["rows"].append(t.num_rows)
            rows["bytes"].append(seg.size)
            rows["status"].append("ok")
            rows["error"].append("")
            rows["ingested_at"].append(now)
        backend.insert_arrow("segments", pa.Table.from_pydict(rows, schema=S.SEGMENTS_SCHEMA))
        for seg, sid, t in batch:
            known.add(sid)
            res.segments_loaded += 1
            res.rows += t.num_rows
            if kind == "tensors":
                res.records += t.num_rows
                res.payload_bytes += int(pc.sum(t.column("nbytes")).as_py() or 0)
            if delete:
                try:
                    os.unlink(seg.path)
                except OSError:
                    pass

    for seg in segments:
        size = seg.size
        try:
            sid = peek_segment_id(seg)
            if sid in known:
                res.segments_skipped += 1
                if delete:
                    try:
                        os.unlink(seg.path)
                    except OSError:
                        pass
                if progress:
                    progress(size)
                continue
            table = read_segment(seg)
        except (CorruptSegmentError, OSError) as e:
            msg = str(e)
            res.segments_corrupt += 1
            res.errors.append(msg)
            log.error("DMI: corrupt spool segment skipped: %s", msg)
            _record_corrupt(backend, seg, spool_root, msg)
            if delete:
                try:
                    os.rename(seg.path, seg.path + ".corrupt")
                except OSError:
                    pass
            if progress:
                progress(size)
            continue
        pending.setdefault(seg.kind, []).append((seg, sid, table))
        pending_bytes[seg.kind] = pending_bytes.get(seg.kind, 0) + table.nbytes
        if pending_bytes[seg.kind] >= max_batch_bytes:
            commit(seg.kind)
        if progress:
            progress(size)
    for kind in list(pending):
        commit(kind)
    return res


def _record_corrupt(backend: Backend, seg: Segment, spool_root: str, msg: str) -> None:
    import hashlib

    sid = "corrupt:" + hashlib.sha1(f"{os.path.abspath(seg.path)}:{seg.size}".encode()).hexdigest()
    row = {"segment_id": [sid], "path": [os.path.relpath(seg.path, spool_root)], "kind": [seg.kind],
           "rank": [seg.rank], "rows": [0], "bytes": [seg.size], "status": ["corrupt"], "error": [msg[:2000]],
           "ingested_at": [_now()]}
    try:
        backend.insert_arrow("segments", pa.Table.from_pydict(row, schema=S.SEGMENTS_SCHEMA))
    except Exception as e:  # bookkeeping only
        log.warning("DMI: could not record corrupt segment %s: %s", seg.path, e)


class IngesterThread:
    """The per-node ingester: a background thread that owns the embedded store and loads every
    rank's completed spool segments into it in batches, off the training thread.

    If another process already owns the store (e.g. the ingester of another node on a shared file
    system), this one stands down: that owner ingests every rank folder, including ours.
    """

    def __init__(self, store_dir: str, database: str = S.DEFAULT_DATABASE, poll_s: float = 2.0,
                 max_batch_bytes: int = 256 << 20):
        self.store_dir = store_dir
        self.spool_root = os.path.join(store_dir, "spool")
        self.database = database
        self.poll_s = poll_s
        self.max_batch_bytes = max_batch_bytes
        self.result = IngestResult()
        self.backend: ChdbBackend | None = None
        self.owner = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pass_lock = threading.Lock()
        self._known: set[str] | None = None
        self._thread: threading.Thread | None = None
        self._finalized = False

    def start(self) -> "IngesterThread":
        try:
            self._open()
        except StoreBusyError as e:
            log.warning("DMI: not ingesting on this node: %s", e)
            return self
        except Exception as e:
            msg = f"DMI ingester could not open the store {self.store_dir}: {type(e).__name__}: {e}"
            log.error(msg)
            self.result.errors.append(msg)
            return self
        self._thread = threading.Thread(target=self._loop, name="dmi-ingester", daemon=True)
        self._thread.start()
        return self

    def _open(self) -> None:
        if self.backend is None:
            b = ChdbBackend(os.path.join(self.store_dir, "chdb"), self.database)
            try:
                b.ensure_schema()
            except BaseException:
                b.close()
                raise
            self.backend = b
            self.owner = True

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.run_pass()
            except Exception as e:  # keep training alive; the final pass and readers retry
                msg = f"DMI ingest pass failed: {type(e).__name__}: {e}"
                log.error(msg)
                self.result.errors.append(msg)
                time.sleep(min(10.0, self.poll_s * 2))

    def run_pass(self) -> IngestResult:
        with self._pass_lock:
            if self.backend is None:
                return IngestResult()
            if self._known is None:
                self._known = known_segment_ids(self.backend)
            r = ingest_spool(self.backend, self.spool_root, delete=True, known=self._known,
                             max_batch_bytes=self.max_batch_bytes)
            self.result.add(r)
            return r

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def final_ingest(self, close: bool = True) -> IngestResult:
        """Stop the thread and load everything left (every rank must have closed its sink)."""
        self.stop()
        r = IngestResult()
        if self.backend is not None:
            try:
                r = self.run_pass()
            except Exception as e:
                msg = f"DMI final ingest failed (segments stay in the spool; a reader loads them): {type(e).__name__}: {e}"
                log.error(msg)
                self.result.errors.append(msg)
                r.errors.append(msg)
            if close:
                self.backend.close()
                self.backend = None
        return r
