"""The spool writer: per-rank Parquet segments that are complete or absent, never half written.

The layout, the segment formats and how they read back are the store's (store/segments.py). A
segment is written to a hidden temporary name in the same folder and renamed to its final name,
so a killed process leaves either the whole segment or only a ``.tmp`` file that nothing reads.
Metadata segments are fsync'd at once; tensor segments are written with ``durable=False`` and
fsync'd together by ``sync()`` (the sinks call it on every flush: checkpoints and the end of the
run), because an fsync per segment cost more than the Parquet write on the disks measured. Page
cache survives a killed process, so only a machine crash can lose what was written after the
last flush. Each segment carries a unique id in its Parquet metadata: ingesting is
idempotent by that id, whatever the file is called.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from megatron.core.dmi.errors import InvalidArgumentError
from megatron.core.dmi.sinks.base import Waiting
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store.segments import (
    META_ID,
    META_KIND,
    META_RANK,
    META_ROWS,
    META_RUN,
    META_VERSION,
    RAW_NAME_RE,
    rank_dir,
)

# Columns small enough to profit from dictionary encoding in Parquet; payload never does.
_DICT_COLUMNS = ["run_id", "phase", "output", "dtype", "reason", "hostname", "sink"]


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # already ingested and deleted
        return 0


class SpoolWriter:
    """Writes one rank's segments. Thread-safe (the drain thread and the training thread share it)."""

    def __init__(self, spool_root: str, rank: int, run_id: str | None = None):
        """The writer of rank ``rank``'s folder under ``spool_root``; ``run_id`` is stamped on its segments."""
        self.rank = rank
        self.run_id = run_id or ""
        self.dir = rank_dir(spool_root, rank)
        self._lock = threading.Lock()
        self._dir_ready = False
        self._seq = None
        self._unsynced: list[str] = []
        # tensor segments written -> rows, when, size on disk (until ingested and deleted)
        self._tensor_rows: dict[str, tuple[int, float, int]] = {}

    def _prepare(self) -> None:
        if self._dir_ready:
            return
        os.makedirs(self.dir, exist_ok=True)
        # This folder belongs to this rank of this process alone (claim_rank_dir): a temporary
        # file here is a leftover of a crash.
        # Continue numbering after every segment already present (a resumed attempt may share it).
        top = 0
        for name in os.listdir(self.dir):
            if name.startswith(".") and name.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
                continue
            m = re.search(r"(\d{8})\.parquet", name)
            if m:
                top = max(top, int(m.group(1)))
        self._seq = top
        self._dir_ready = True

    def native_target(self, segment_bytes: int) -> dict:
        """Where and how the native spool writer writes this rank's tensor segments: the folder,
        the first free ``.dmiraw`` number and the header every segment carries."""
        with self._lock:
            self._prepare()
        top = max((int(m.group(1)) for m in map(RAW_NAME_RE.match, os.listdir(self.dir)) if m), default=0)
        header = {
            "kind": "tensors",
            "schema_version": S.SCHEMA_VERSION,
            "rank": self.rank,
            "run_id": self.run_id,
            "writer_id": uuid.uuid4().hex,
            "first_seq": top + 1,
        }  # segment numbers then run without gaps
        return {"directory": self.dir, "first_seq": top + 1, "header": header, "segment_bytes": segment_bytes}

    def adopt(self, path: str, rows: int) -> None:
        """Count a tensor segment another writer (the native one) put in this folder."""
        size = _size(path)  # one stat per segment, when it closes
        with self._lock:
            self._tensor_rows[path] = (rows, time.monotonic(), size)

    def write(self, kind: str, table: pa.Table, durable: bool = True) -> str:
        """Write ``table`` as one segment of ``kind``; returns the final path. Raises OSError (e.g.
        ENOSPC) with no partial file left behind. Several threads may write at once (each segment
        gets its own number). ``durable=False`` defers the fsync to the next ``sync()``."""
        if kind not in S.KIND_SCHEMAS:
            raise InvalidArgumentError(f"unknown spool kind {kind!r} (expected one of {sorted(S.KIND_SCHEMAS)})")
        with self._lock:
            self._prepare()
            self._seq += 1
            seq = self._seq
        name = f"{seq:08d}.parquet" if kind == "tensors" else f"{kind}-{seq:08d}.parquet"
        final = os.path.join(self.dir, name)
        tmp = os.path.join(self.dir, f".{name}.{os.getpid()}.tmp")
        meta = dict(table.schema.metadata or {})
        meta.update(
            {
                META_ID: uuid.uuid4().hex.encode(),
                META_KIND: kind.encode(),
                META_VERSION: str(S.SCHEMA_VERSION).encode(),
                META_RANK: str(self.rank).encode(),
                META_RUN: self.run_id.encode(),
                META_ROWS: str(table.num_rows).encode(),
            }
        )
        table = table.replace_schema_metadata(meta)
        try:
            pq.write_table(
                # A path, not a Python file object: Arrow then writes through its own file stream
                # without the GIL. Through a Python file every page becomes a bytes object built
                # with the GIL held, which stalled the training thread's kernel launches (seen on
                # an H200: +70 % step time at 256 MB/step of attention, none under CUDA graphs).
                # Payloads are mostly incompressible floats and the store recompresses them;
                # compressing here only slows the drain.
                table,
                tmp,
                compression={c: ("none" if c == "payload" else "zstd") for c in table.schema.names},
                use_dictionary=[c for c in _DICT_COLUMNS if c in table.schema.names],
                write_statistics=[c for c in table.schema.names if c != "payload"],
                row_group_size=max(1, min(table.num_rows, 8192)),
                write_page_checksum=True,  # every page, keys included, verifies on read
            )
            if durable:
                _fsync_path(tmp)
            size = os.stat(tmp).st_size  # before the rename: an ingester may take it at once
            os.rename(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if durable:
            _fsync_dir(self.dir)
        with self._lock:
            if not durable:
                self._unsynced.append(final)
            if kind == "tensors":
                self._tensor_rows[final] = (table.num_rows, time.monotonic(), size)
        return final

    def waiting(self) -> Waiting:
        """The tensor segments this writer wrote (or adopted) that are still in the spool (not yet
        ingested and deleted): their rows, the seconds the oldest has waited, their bytes. A stat
        per segment, no file reads: it runs on the training thread, and on the drain's at a bound."""
        with self._lock:
            paths = list(self._tensor_rows)
        gone = [p for p in paths if not os.path.exists(p)]
        with self._lock:
            for p in gone:
                self._tensor_rows.pop(p, None)
            rows = sum(n for n, _, _ in self._tensor_rows.values())
            oldest = min((t for _, t, _ in self._tensor_rows.values()), default=None)
            size = sum(b for _, _, b in self._tensor_rows.values())
        return Waiting(rows, 0.0 if oldest is None else time.monotonic() - oldest, size)

    def sync(self) -> None:
        """Flush (fsync) every segment written with ``durable=False`` since the last call, then the folder
        (a segment already ingested and deleted needs nothing)."""
        with self._lock:
            paths, self._unsynced = self._unsynced, []
        for path in paths:
            try:
                _fsync_path(path)
            except FileNotFoundError:
                continue
        if paths:
            _fsync_dir(self.dir)


__all__ = ["SpoolWriter"]
