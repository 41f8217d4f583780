"""Snapshot reads: a reader opens a hard-linked copy of an embedded store, never the store itself.

chDB, like a ClickHouse server, lets one process open a store directory (it flocks the store's
``status`` file), and a training run's ingester holds its store for the whole run. MergeTree data
parts never change once written (an insert or a merge builds a new part under a ``tmp_`` name and
renames it into place; old parts are only ever deleted), so a consistent copy needs no bytes copied:
the part files are hard-linked, the few small files around them (table metadata, format version)
are copied, and chDB's own ``status`` lock file is left out. Parts covered by a merged part are
skipped (they wait a few minutes for deletion, and chDB would only discard them on open).

The snapshot also links the spool's complete segments, before it links the store: a segment that
the ingester loads and deletes in between is then in one or both, never in neither, and the
reader loads the spool into its copy (``ingest_spool(delete=False)``), so a view holds every
record the run has written to a closed segment, whether or not the ingester has loaded it yet.

Snapshots live in ``<store_dir>/.readers/`` (hard links need the same file system) and are removed
when the reader closes (the folder too, once empty); ones left by a killed reader of this host are
removed by the next one.

A snapshot needs some room on the store's file system (directories, the copied small files, the
snapshot's own chDB files, the spool it loads): ``out_of_space`` tells the reader when that room is
missing, so it can read a finished store in place instead (reader/store.py).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass

SNAPSHOTS_DIR = ".readers"
CHDB_LOCK_FILE = "status"  # chDB's flock'd lock file at the store root: a snapshot gets its own
_PART_RE = re.compile(r"^(?P<partition>[^_]+)_(?P<min>\d+)_(?P<max>\d+)_(?P<level>\d+)(?:_(?P<mutation>\d+))?$")
_TABLE_MARKER = "format_version.txt"  # present in every MergeTree table's data directory


_NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, file size limit
# chDB reports the same OS errors in its own exception text (its error code, or the errno's message)
_NO_ROOM_TEXTS = ("NOT_ENOUGH_SPACE", "No space left on device", "Disk quota exceeded", "File too large")


def out_of_space(exc: BaseException) -> bool:
    """``exc`` says the file system had no room for a write: an OSError of a full disk, a quota or
    the file size limit, or chDB's exception carrying one."""
    if isinstance(exc, OSError) and exc.errno in _NO_ROOM_ERRNOS:
        return True
    return any(text in str(exc) for text in _NO_ROOM_TEXTS)


@dataclass
class SnapshotStats:
    """What making a snapshot took: data parts linked or skipped, files linked or copied, time."""

    parts: int = 0  # data parts linked
    parts_covered: int = 0  # parts skipped: a merged part holds their rows
    parts_vanished: int = 0  # deleted by the store's owner while linking (then covered by a newer part)
    files_linked: int = 0
    files_copied: int = 0
    spool_segments: int = 0
    seconds: float = 0.0


def _part_key(name: str) -> tuple[str, int, int, int, int] | None:
    """(partition, min block, max block, level, mutation) of a part directory name; None for anything
    else (``detached``, ``tmp_insert_*`` and ``tmp_merge_*`` parts still being written)."""
    m = _PART_RE.match(name)
    if m is None:
        return None
    return (m["partition"], int(m["min"]), int(m["max"]), int(m["level"]), int(m["mutation"] or 0))


def _active_parts(names: list[str]) -> tuple[list[str], int]:
    """The parts not covered by another part of the same partition, and how many were covered."""
    keys = {n: k for n in names if (k := _part_key(n)) is not None}

    def rank(k):
        return (k[2] - k[1], k[3], k[4])

    active = [
        n
        for n, k in keys.items()
        if not any(
            o != n and ok[0] == k[0] and ok[1] <= k[1] and ok[2] >= k[2] and rank(ok) > rank(k)
            for o, ok in keys.items()
        )
    ]
    return sorted(active), len(keys) - len(active)


def _link_tree(src: str, dst: str, stats: SnapshotStats) -> None:
    """Hard-link every file of one part directory (projections included)."""
    for root, _dirs, files in os.walk(src):
        out = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(out, exist_ok=True)
        for f in files:
            os.link(os.path.join(root, f), os.path.join(out, f))
            stats.files_linked += 1


def _snapshot_table(src: str, dst: str, names: list[str], stats: SnapshotStats) -> None:
    os.makedirs(os.path.join(dst, "detached"), exist_ok=True)
    dirs = [n for n in names if os.path.isdir(os.path.join(src, n)) and not os.path.islink(os.path.join(src, n))]
    active, covered = _active_parts(dirs)
    stats.parts_covered += covered
    for part in active:
        try:
            _link_tree(os.path.join(src, part), os.path.join(dst, part), stats)
            stats.parts += 1
        except FileNotFoundError:
            shutil.rmtree(os.path.join(dst, part), ignore_errors=True)
            stats.parts_vanished += 1
    for n in names:
        p = os.path.join(src, n)
        if os.path.isfile(p) and not os.path.islink(p):
            shutil.copy2(p, os.path.join(dst, n))
            stats.files_copied += 1


def link_store(src: str, dst: str, stats: SnapshotStats | None = None) -> SnapshotStats:
    """Snapshot the chDB store directory ``src`` into ``dst`` (which must not exist)."""
    stats = stats or SnapshotStats()
    t0 = time.monotonic()
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        out = os.path.join(dst, rel)
        os.makedirs(out, exist_ok=True)
        for d in list(dirs):  # Atomic databases link data/<db>/<table> and metadata/<db> into store/
            if os.path.islink(os.path.join(root, d)):
                os.symlink(os.readlink(os.path.join(root, d)), os.path.join(out, d))
                dirs.remove(d)
        if _TABLE_MARKER in files:
            _snapshot_table(root, out, dirs + files, stats)
            dirs[:] = []
            continue
        if rel == ".":
            dirs[:] = [d for d in dirs if d != "tmp"]  # chDB's scratch space
            files = [f for f in files if f != CHDB_LOCK_FILE]
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p):
                os.symlink(os.readlink(p), os.path.join(out, f))
            else:
                try:
                    shutil.copy2(p, os.path.join(out, f))
                    stats.files_copied += 1
                except FileNotFoundError:
                    pass
    stats.seconds += time.monotonic() - t0
    return stats


def link_spool(spool_root: str, dst: str, stats: SnapshotStats | None = None) -> SnapshotStats:
    """Hard-link every complete spool segment under ``spool_root`` into ``dst`` (same rank folders)."""
    from megatron.core.dmi.store.segments import list_segments

    stats = stats or SnapshotStats()
    t0 = time.monotonic()
    for seg in list_segments(spool_root):
        out = os.path.join(dst, os.path.relpath(seg.path, spool_root))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        try:
            os.link(seg.path, out)
            stats.spool_segments += 1
        except FileNotFoundError:  # ingested and deleted since listed: the store snapshot (taken next) holds it
            pass
    stats.seconds += time.monotonic() - t0
    return stats


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ReaderSnapshot:
    """A private snapshot folder under ``<store_dir>/.readers/``: ``chdb`` and ``spool`` inside."""

    def __init__(self, store_dir: str):
        """Create this reader's snapshot folder under ``store_dir``, first removing those of this host's readers that
        are gone."""
        root = os.path.join(store_dir, SNAPSHOTS_DIR)
        os.makedirs(root, exist_ok=True)
        host = socket.gethostname()
        self._remove_stale(root, host)
        self.path = os.path.join(root, f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.path)
        self.chdb_path = os.path.join(self.path, "chdb")
        self.spool_root = os.path.join(self.path, "spool")

    @staticmethod
    def _remove_stale(root: str, host: str) -> None:
        for name in os.listdir(root):
            prefix, _, tail = name.partition(f"{host}-")
            if prefix or not tail:
                continue  # another host's reader (shared file system): not ours to judge
            pid = tail.split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def close(self) -> None:
        """Delete the snapshot folder, and ``.readers/`` too when no other reader's snapshot is left in it."""
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.path))  # the last reader leaves the store as it found it
        except OSError:
            pass  # another reader's snapshot is still there
