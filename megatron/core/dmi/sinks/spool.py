"""Spool segments: per-rank Parquet files that are complete or absent, never half written.

Layout under a store directory::

    <store_dir>/spool/rank-<global rank 05d>/<seq 08d>.parquet          tensor records
    <store_dir>/spool/rank-<global rank 05d>/<seq 08d>.dmiraw           tensor records (native writer)
    <store_dir>/spool/rank-<global rank 05d>/<kind>-<seq 08d>.parquet   runs, topology, drops, reports

``.dmiraw`` segments come from the native ring's C++ spool writer (csrc/dmi/spool_writer.h: the
record descriptors and payloads as they left the ring, plus each site's static key); they read
back as the same tensor table as a Parquet segment. Their numbers count on their own. Every
segment verifies itself (format 2 raw segments: a CRC over every block and a footer with totals,
docs/storage.md; Parquet: page CRCs and a row count), and ``verify_segment`` separates what
verifies from what does not.

A segment is written to a hidden temporary name in the same folder and renamed to its final name,
so a killed process leaves either the whole segment or only a ``.tmp`` file that nothing reads.
Metadata segments are fsync'd at once; tensor segments are written with ``durable=False`` and
fsync'd together by ``sync()`` (the sinks call it on every flush: checkpoints and the end of the
run), because an fsync per segment cost more than the Parquet write on the disks measured. Page
cache survives a killed process, so only a machine crash can lose what was written after the
last flush. Each segment carries a unique id in its Parquet metadata: ingesting is
idempotent by that id, whatever the file is called.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megatron.core.dmi.records import (
    DESCRIPTOR_COLUMNS,
    PHASES,
    Firing,
    RecordKey,
    descriptor_table,
    table_nbytes,
)
from megatron.core.dmi.sinks import schema as S

SEGMENT_RE = re.compile(r"^(?:(?P<kind>[a-z_]+)-(?P<mseq>\d{8})\.parquet|(?P<seq>\d{8})\.(?P<ext>parquet|dmiraw))$")
RAW_EXT = "dmiraw"
RAW_NAME_RE = re.compile(r"^(\d{8})\.dmiraw$")
# Raw segment format 2 (docs/storage.md); format 1 had no CRC over keys and no footer.
RAW_MAGIC, SITE_MAGIC, RECS_MAGIC, END_MAGIC = b"DMIRAW02", b"DMISITE2", b"DMIRECS2", b"DMIEND02"
OLD_RAW_MAGIC = b"DMIRAW01"
RANK_DIR_RE = re.compile(r"^rank-(?P<rank>\d{5,})$")
META_ID = b"dmi.segment_id"
META_KIND = b"dmi.kind"
META_VERSION = b"dmi.schema_version"
META_RANK = b"dmi.rank"
META_RUN = b"dmi.run_id"
META_ROWS = b"dmi.rows"  # a Parquet segment's row count, checked on read (with its page CRCs)

# Columns small enough to profit from dictionary encoding in Parquet; payload never does.
_DICT_COLUMNS = ["run_id", "phase", "output", "dtype", "reason", "hostname", "sink"]


class CorruptSegmentError(RuntimeError):
    pass


class StoreInUseError(SystemExit):
    """Another live process writes this rank's spool folder (a second run on the same
    ``--dmi-store-dir``). A SystemExit, so the run stops at start-up with this one line and no
    traceback, before it writes anything."""


_owned: dict[str, list] = {}  # rank folder -> [lock fd, users] held by this process
_owned_lock = threading.Lock()


def claim_rank_dir(folder: str, run_id: str) -> None:
    """Make this process the one writer of ``folder`` for as long as it holds the claim (another
    process's spool writer would delete or overwrite our open segments); StoreInUseError names
    the holder. Claims by one process nest (``release_rank_dir`` once per claim)."""
    folder = os.path.realpath(folder)
    with _owned_lock:
        if folder in _owned:
            _owned[folder][1] += 1
            return
        os.makedirs(folder, exist_ok=True)
        # Beside the folder, not in it: the folder empties as the ingester consumes it.
        lock = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.owner.lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            store = os.path.dirname(os.path.dirname(folder))
            raise StoreInUseError(
                f"error: --dmi-store-dir {store} is in use by another DMI run ({holder}); two runs cannot share "
                f"a store directory: give this run its own --dmi-store-dir, or wait for that run to end") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, run {run_id or '?'}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), 0)
        _owned[folder] = [fd, 1]


def release_rank_dir(folder: str) -> None:
    folder = os.path.realpath(folder)
    with _owned_lock:
        held = _owned.get(folder)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _owned[folder]
            os.close(held[0])  # drops the flock


def rank_dir(spool_root: str, rank: int) -> str:
    return os.path.join(spool_root, f"rank-{rank:05d}")


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


class SpoolWriter:
    """Writes one rank's segments. Thread-safe (the drain thread and the training thread share it)."""

    def __init__(self, spool_root: str, rank: int, run_id: str | None = None):
        self.rank = rank
        self.run_id = run_id or ""
        self.dir = rank_dir(spool_root, rank)
        self._lock = threading.Lock()
        self._dir_ready = False
        self._seq = None
        self._unsynced: list[str] = []
        self._tensor_rows: dict[str, int] = {}  # tensor segments written -> rows (until ingested)

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
        header = {"kind": "tensors", "schema_version": S.SCHEMA_VERSION, "rank": self.rank, "run_id": self.run_id,
                  "writer_id": uuid.uuid4().hex, "first_seq": top + 1}  # segment numbers then run without gaps
        return {"directory": self.dir, "first_seq": top + 1, "header": header, "segment_bytes": segment_bytes}

    def adopt(self, path: str, rows: int) -> None:
        """Count a tensor segment another writer (the native one) put in this folder."""
        with self._lock:
            self._tensor_rows[path] = rows

    def write(self, kind: str, table: pa.Table, durable: bool = True) -> str:
        """Write ``table`` as one segment of ``kind``; returns the final path. Raises OSError (e.g.
        ENOSPC) with no partial file left behind. Several threads may write at once (each segment
        gets its own number). ``durable=False`` defers the fsync to the next ``sync()``."""
        if kind not in S.KIND_SCHEMAS:
            raise ValueError(f"unknown spool kind {kind!r}")
        with self._lock:
            self._prepare()
            self._seq += 1
            seq = self._seq
        name = f"{seq:08d}.parquet" if kind == "tensors" else f"{kind}-{seq:08d}.parquet"
        final = os.path.join(self.dir, name)
        tmp = os.path.join(self.dir, f".{name}.{os.getpid()}.tmp")
        meta = dict(table.schema.metadata or {})
        meta.update({META_ID: uuid.uuid4().hex.encode(), META_KIND: kind.encode(),
                     META_VERSION: str(S.SCHEMA_VERSION).encode(), META_RANK: str(self.rank).encode(),
                     META_RUN: self.run_id.encode(), META_ROWS: str(table.num_rows).encode()})
        table = table.replace_schema_metadata(meta)
        try:
            pq.write_table(
                # A path, not a Python file object: Arrow then writes through its own file stream
                # without the GIL. Through a Python file every page becomes a bytes object built
                # with the GIL held, which stalled the training thread's kernel launches (seen on
                # an H200: +70 % step time at 256 MB/step of attention, none under CUDA graphs).
                # Payloads are mostly incompressible floats and the store recompresses them;
                # compressing here only slows the drain.
                table, tmp, compression={c: ("none" if c == "payload" else "zstd") for c in table.schema.names},
                use_dictionary=[c for c in _DICT_COLUMNS if c in table.schema.names],
                write_statistics=[c for c in table.schema.names if c != "payload"],
                row_group_size=max(1, min(table.num_rows, 8192)),
                write_page_checksum=True,  # every page, keys included, verifies on read
            )
            if durable:
                _fsync_path(tmp)
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
                self._tensor_rows[final] = table.num_rows
        return final

    def waiting_rows(self) -> int:
        """Rows of the tensor segments this writer wrote that are still in the spool (not yet
        ingested and deleted). A stat per segment, no file reads: it runs on the training thread."""
        with self._lock:
            paths = list(self._tensor_rows)
        gone = [p for p in paths if not os.path.exists(p)]
        with self._lock:
            for p in gone:
                self._tensor_rows.pop(p, None)
            return sum(self._tensor_rows.values())

    def sync(self) -> None:
        """fsync every segment written with ``durable=False`` since the last call, then the folder
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


@dataclass(frozen=True)
class Segment:
    path: str
    rank: int
    kind: str
    seq: int

    @property
    def raw(self) -> bool:
        return self.path.endswith("." + RAW_EXT)

    @property
    def size(self) -> int:
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0


def list_segments(spool_root: str, ranks: set[int] | None = None) -> list[Segment]:
    """Every complete segment under ``spool_root`` (a ``spool`` folder holding ``rank-*`` folders,
    or a single ``rank-*`` folder), ordered by rank then sequence."""
    out: list[Segment] = []
    root = os.path.abspath(spool_root)
    m = RANK_DIR_RE.match(os.path.basename(root))
    folders = [(root, int(m.group("rank")))] if m else []
    if not m and os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            mm = RANK_DIR_RE.match(name)
            if mm and os.path.isdir(os.path.join(root, name)):
                folders.append((os.path.join(root, name), int(mm.group("rank"))))
    for folder, rank in folders:
        if ranks is not None and rank not in ranks:
            continue
        for name in os.listdir(folder):
            sm = SEGMENT_RE.match(name)
            if sm:
                seq = int(sm.group("seq") or sm.group("mseq"))
                out.append(Segment(os.path.join(folder, name), rank, sm.group("kind") or "tensors", seq))
    out.sort(key=lambda s: (s.rank, s.seq))
    return out


def segment_id_of(seg: Segment, metadata: dict | None) -> str:
    if metadata and META_ID in metadata:
        return metadata[META_ID].decode()
    st = os.stat(seg.path)
    return "path:" + hashlib.sha1(f"{os.path.abspath(seg.path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def peek_segment_id(seg: Segment) -> str:
    """The segment's id from its footer (Parquet) or header (raw) alone; raises CorruptSegmentError."""
    if seg.raw:
        return _raw_segment_id(_raw_header(seg.path)[0])
    try:
        md = pq.read_schema(seg.path).metadata
    except Exception as e:
        raise CorruptSegmentError(f"{seg.path}: unreadable Parquet footer ({type(e).__name__}: {e})") from None
    return segment_id_of(seg, md)


@dataclass(frozen=True)
class Quarantined:
    """A record (``row``: its index in the segment) or a part of a segment (``row`` -1) that did not
    verify; ``key`` holds whatever of its key could still be trusted."""

    row: int
    reason: str
    key: dict


@dataclass
class VerifiedSegment:
    """What a segment holds that verified (``table``), what did not (``quarantined``), and what is
    wrong with the segment as a whole (``problems``: a damaged block, a missing footer ...)."""

    table: pa.Table
    quarantined: list[Quarantined]
    problems: list[str]

    @property
    def clean(self) -> bool:
        return not self.quarantined and not self.problems

    def summary(self, path: str) -> str:
        records = [q for q in self.quarantined if q.row >= 0]
        parts = list(self.problems)
        if records:
            parts.append(f"{len(records)} record(s) quarantined ({records[0].reason}" + (", ..." if len(records) > 1 else "") + ")")
        return f"{path}: " + "; ".join(parts) + f"; {self.table.num_rows} verified record(s) kept"


_HEAD = struct.Struct("<8sQQQ")  # magic, a, b, crc of every block of a format-2 raw segment


def _block_crc_ok(buf, pos: int, body_len: int, crc: int) -> bool:
    mem = memoryview(buf)
    return zlib.crc32(mem[pos + _HEAD.size : pos + _HEAD.size + body_len], zlib.crc32(mem[pos : pos + 24])) == crc


def _covered_len(magic: bytes, a: int, b: int) -> int | None:
    """Bytes after a block's head that its CRC covers (payloads are not: they have their own)."""
    return {SITE_MAGIC: b + (-b) % 8, RECS_MAGIC: a * len(DESCRIPTOR_COLUMNS) * 8, END_MAGIC: 16}.get(magic)


def _resync(buf, pos: int) -> int | None:
    """Where reading may go on after the damaged block at ``pos``: the end its head claims, if a
    block that verifies starts there (a flipped bit in the body leaves the lengths intact); None
    when nothing after it can be trusted."""
    magic, a, b, _ = _HEAD.unpack_from(buf, pos)
    covered = _covered_len(magic, a, b)
    if covered is None:
        return None
    nxt = pos + _HEAD.size + covered + ((b + (-b) % 8) if magic == RECS_MAGIC else 0)
    if nxt + _HEAD.size > buf.size:
        return None
    m2, a2, b2, crc2 = _HEAD.unpack_from(buf, nxt)
    covered2 = _covered_len(m2, a2, b2)
    if covered2 is None or nxt + _HEAD.size + covered2 > buf.size or not _block_crc_ok(buf, nxt, covered2, crc2):
        return None
    return nxt


def _raw_header(path: str) -> tuple[dict, int]:
    """A raw segment's header (with its ``seq`` and block ``crc``) and where its first block starts."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            magic, seq, n, crc = _HEAD.unpack(head) if len(head) == _HEAD.size else (head[:8], 0, 0, 0)
            if magic == OLD_RAW_MAGIC:
                raise CorruptSegmentError(
                    f"{path}: raw segment of format 1 (written before megatron-dmi checksummed keys); this "
                    f"release reads format 2 only: load it with the release that wrote it")
            if magic != RAW_MAGIC:
                raise CorruptSegmentError(f"{path}: not a DMI raw segment (bad magic)")
            if n > 1 << 24:
                raise CorruptSegmentError(f"{path}: damaged raw segment header (length {n})")
            body = f.read(n + (-n) % 8)
        if zlib.crc32(body, zlib.crc32(head[:24])) != crc:
            raise CorruptSegmentError(f"{path}: damaged raw segment header (CRC mismatch)")
        header = json.loads(body[:n])
    except (OSError, ValueError) as e:
        raise CorruptSegmentError(f"{path}: unreadable raw segment header ({type(e).__name__}: {e})") from None
    header["seq"], header["crc"] = seq, crc
    return header, _HEAD.size + n + (-n) % 8


def _raw_segment_id(header: dict) -> str:
    """Unique per segment: the writer's id (new at every start) and the segment's number."""
    return f"{header.get('writer_id', 'raw')}-{header['seq']}"


def raw_numbering(seg: Segment) -> tuple[str, int, int]:
    """(writer id, segment number, the writer's first number) from a raw segment's header."""
    header = _raw_header(seg.path)[0]
    return header.get("writer_id", "raw"), header["seq"], int(header.get("first_seq", header["seq"]))


def raw_writer_of(segment_id: str) -> tuple[str, int] | None:
    """(writer id, segment number) of a raw segment's id; None for other ids."""
    writer, _, seq = segment_id.rpartition("-")
    return (writer, int(seq)) if writer and seq.isdigit() else None


def _row_key(sites: dict, row: np.ndarray) -> dict:
    d = dict(zip(DESCRIPTOR_COLUMNS, (int(v) for v in row)))
    site = sites.get(d["site"])
    key = {k: v for k, v in site.flat().items() if k not in Firing._fields} if site else {}
    key.update({k: d[k] for k in ("iteration", "microbatch", "attempt", "invocation")})
    key["phase"] = PHASES[d["phase"]] if d["phase"] < len(PHASES) else f"#{d['phase']}"
    return key


def _records_block(sites: dict, rows: np.ndarray, data: pa.Buffer, first_row: int,
                   quarantined: list[Quarantined]) -> pa.Table | None:
    """The verified records of one records block; the others go to ``quarantined``."""
    nbytes = rows[:, DESCRIPTOR_COLUMNS.index("nbytes")]
    ends = np.cumsum(nbytes)
    good = np.ones(len(rows), dtype=bool)
    mem = memoryview(data)
    for i, row in enumerate(rows):
        site, phase, crc = (int(row[DESCRIPTOR_COLUMNS.index(c)]) for c in ("site", "phase", "crc32"))
        why = ("site undefined in this segment" if site not in sites else
               f"phase word {phase} out of range" if phase >= len(PHASES) else
               "payload CRC mismatch" if zlib.crc32(mem[int(ends[i] - nbytes[i]) : int(ends[i])]) != crc else None)
        if why:
            good[i] = False
            quarantined.append(Quarantined(first_row + i, why, _row_key(sites, row)))
    if not good.any():
        return None
    stand_in = rows.copy()  # a table of every row (payloads stay back to back), then the good ones
    stand_in[~good, DESCRIPTOR_COLUMNS.index("site")] = next(iter(sites))
    stand_in[~good, DESCRIPTOR_COLUMNS.index("phase")] = 0
    table = descriptor_table(sites, stand_in, data)
    return table if good.all() else table.filter(pa.array(good))


def verify_raw_segment(path: str) -> VerifiedSegment:
    """Read a ``.dmiraw`` segment, checking every block CRC, every payload CRC and the footer's
    totals. Records that verify are returned (the payload column views the memory-mapped file);
    the rest are quarantined. Raises CorruptSegmentError only when the header itself is bad."""
    header, pos = _raw_header(path)
    if header.get("schema_version") != S.SCHEMA_VERSION:
        raise CorruptSegmentError(f"{path}: raw segment of schema version {header.get('schema_version')}, "
                                  f"this megatron-dmi loads version {S.SCHEMA_VERSION}")
    buf = pa.memory_map(path).read_buffer()
    words = len(DESCRIPTOR_COLUMNS)
    sites: dict[int, RecordKey] = {}
    tables, quarantined, problems = [], [], []
    crcs = [header["crc"]]
    rows_seen = payload_seen = 0
    footer = None
    while pos < buf.size and footer is None:
        if pos + _HEAD.size > buf.size:
            problems.append(f"cut short: {buf.size - pos} stray byte(s) at byte {pos}")
            break
        magic, a, b, crc = _HEAD.unpack_from(buf, pos)
        body_len = _covered_len(magic, a, b)
        if body_len is None or pos + _HEAD.size + body_len > buf.size or not _block_crc_ok(buf, pos, body_len, crc):
            resume = _resync(buf, pos)
            end = buf.size if resume is None else resume
            problems.append(f"damaged block at byte {pos}: bytes {pos}-{end} not read")
            quarantined.append(Quarantined(-1, f"bytes {pos}-{end} fail their CRC", {}))
            if resume is None:
                break
            crcs.append(crc)  # the footer still counts the block
            if magic == RECS_MAGIC:  # its records are counted, and lost, with the range above
                rows_seen += a
                payload_seen += b
            pos = resume
            continue
        crcs.append(crc)
        body = pos + _HEAD.size
        if magic == SITE_MAGIC:
            try:
                sites[a] = RecordKey.from_flat(json.loads(buf.slice(body, b).to_pybytes()))
            except (ValueError, KeyError, TypeError) as e:  # CRC-clean, so a writer bug, but never fatal
                problems.append(f"site {a} at byte {pos} undecodable ({type(e).__name__}: {e})")
        elif magic == RECS_MAGIC:
            rows = np.frombuffer(buf, dtype=np.uint64, count=a * words, offset=body).reshape(a, words)
            data_at = body + body_len
            if data_at + b > buf.size or int(rows[:, DESCRIPTOR_COLUMNS.index("nbytes")].sum()) != b:
                reason = "payloads cut short" if data_at + b > buf.size else "payload sizes disagree with the block"
                problems.append(f"records block at byte {pos}: {reason}")
                quarantined.extend(Quarantined(rows_seen + i, reason, _row_key(sites, r)) for i, r in enumerate(rows))
                rows_seen += a
                payload_seen += b
                break
            t = _records_block(sites, rows, buf.slice(data_at, b), rows_seen, quarantined)
            if t is not None:
                tables.append(t)
            rows_seen += a
            payload_seen += b
            body_len += b + (-b) % 8
        else:
            footer = (a, b, *struct.unpack_from("<QQ", buf, body))
        pos = body + body_len
    if footer is None and not problems:
        problems.append(f"no footer: the segment was cut short after {rows_seen} record(s)")
    elif footer is not None:
        chain = zlib.crc32(np.array(crcs[:-1], dtype=np.uint64).tobytes())
        if footer != (rows_seen, payload_seen, len(crcs) - 1, chain):
            problems.append(f"footer counts {footer[0]} record(s) in {footer[2]} block(s), the segment holds "
                            f"{rows_seen} in {len(crcs) - 1}: blocks are missing")
        if pos != buf.size:
            problems.append(f"{buf.size - pos} byte(s) after the footer")
    meta = {META_ID: _raw_segment_id(header).encode(), META_KIND: b"tensors",
            META_VERSION: str(S.SCHEMA_VERSION).encode(), META_RANK: str(header.get("rank", "")).encode(),
            META_RUN: str(header.get("run_id", "")).encode()}
    schema = S.KIND_SCHEMAS["tensors"]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    return VerifiedSegment(table.replace_schema_metadata(meta), quarantined, problems)


def read_raw_segment(path: str) -> pa.Table:
    """A whole, intact ``.dmiraw`` segment as the tensor table; CorruptSegmentError if any part of
    it does not verify (``verify_raw_segment`` keeps the parts that do)."""
    v = verify_raw_segment(path)
    if not v.clean:
        raise CorruptSegmentError("damaged raw segment " + v.summary(path))
    return v.table


def segment_rows_bytes(seg: Segment) -> tuple[int, int]:
    """Rows and payload bytes of a tensor segment (raises CorruptSegmentError)."""
    if seg.raw:
        t = read_raw_segment(seg.path)
    else:
        try:
            t = pq.read_table(seg.path, columns=["nbytes"])
        except Exception as e:
            raise CorruptSegmentError(f"{seg.path}: cannot read ({type(e).__name__}: {e})") from None
    return t.num_rows, table_nbytes(t)


def read_segment(seg: Segment) -> pa.Table:
    """Read and validate a whole segment against its kind's schema."""
    if seg.raw:
        return read_raw_segment(seg.path)
    expected = S.KIND_SCHEMAS[seg.kind]
    try:
        table = pq.read_table(seg.path, page_checksum_verification=True)
    except Exception as e:
        raise CorruptSegmentError(f"{seg.path}: cannot read ({type(e).__name__}: {e})") from None
    md = table.schema.metadata or {}
    if META_ROWS in md and int(md[META_ROWS]) != table.num_rows:
        raise CorruptSegmentError(f"{seg.path}: holds {table.num_rows} rows, its metadata says {int(md[META_ROWS])}")
    version = md.get(META_VERSION)
    if version is not None and int(version) != S.SCHEMA_VERSION:
        raise CorruptSegmentError(
            f"{seg.path}: spool segment of schema version {int(version)}, this megatron-dmi loads version {S.SCHEMA_VERSION}"
        )
    if table.schema.names != expected.names:
        raise CorruptSegmentError(f"{seg.path}: columns {table.schema.names} do not match the {seg.kind} schema")
    try:
        table = table.cast(expected.with_metadata(md))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise CorruptSegmentError(f"{seg.path}: column types do not match the {seg.kind} schema ({e})") from None
    return table


def _payload_checks(table: pa.Table) -> np.ndarray:
    """True for each row of a tensor table whose payload matches its ``checksum``."""
    ok = np.empty(table.num_rows, dtype=bool)
    want = table.column("checksum").to_numpy()
    i = 0
    for chunk in table.column("payload").chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64, count=len(chunk) + 1, offset=chunk.offset * 8)
        data = memoryview(chunk.buffers()[2]) if chunk.buffers()[2] is not None else memoryview(b"")
        for j in range(len(chunk)):
            ok[i] = zlib.crc32(data[offsets[j] : offsets[j + 1]]) == want[i]
            i += 1
    return ok


def verify_segment(seg: Segment) -> VerifiedSegment:
    """A segment's records that verify (every CRC, the totals) and the ones that do not; raises
    CorruptSegmentError when nothing in it can be trusted (bad header, unreadable Parquet)."""
    if seg.raw:
        return verify_raw_segment(seg.path)
    table = read_segment(seg)
    if seg.kind != "tensors" or table.num_rows == 0:
        return VerifiedSegment(table, [], [])
    ok = _payload_checks(table)
    if ok.all():
        return VerifiedSegment(table, [], [])
    keys = table.drop_columns(["payload", "nbytes", "checksum", "shape"]).filter(pa.array(~ok)).to_pylist()
    bad = [Quarantined(int(i), "payload CRC mismatch", k) for i, k in zip(np.flatnonzero(~ok), keys)]
    return VerifiedSegment(table.filter(pa.array(ok)), bad, [])


__all__ = [
    "SpoolWriter", "Segment", "list_segments", "read_segment", "read_raw_segment", "segment_rows_bytes",
    "peek_segment_id", "CorruptSegmentError", "rank_dir", "StoreInUseError", "claim_rank_dir", "release_rank_dir", "verify_segment", "verify_raw_segment",
    "VerifiedSegment", "Quarantined",
]
