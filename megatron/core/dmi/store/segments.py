"""Spool segments as the store reads them: finding them, reading them back and verifying them.

A spool holds per-rank segment files that are complete or absent, never half written (the sinks'
``SpoolWriter`` writes them; see sinks/spool.py)::

    <store_dir>/spool/rank-<global rank 05d>/<seq 08d>.parquet          tensor records
    <store_dir>/spool/rank-<global rank 05d>/<seq 08d>.dmiraw           tensor records (native writer)
    <store_dir>/spool/rank-<global rank 05d>/<kind>-<seq 08d>.parquet   runs, topology, drops, reports

``.dmiraw`` segments come from the native ring's C++ spool writer (csrc/dmi/spool_writer.h: the
record descriptors and payloads as they left the ring, plus each site's static key); they read
back as the same tensor table as a Parquet segment. Their numbers count on their own. Every
segment verifies itself (format 2 raw segments: a CRC over every block and a footer with totals,
read by ``raw_segment``; Parquet: page CRCs and a row count; both: a CRC per payload), and ``verify_segment`` separates
what verifies from what does not. Each segment carries a unique id (Parquet metadata or the raw
header): ingesting is idempotent by that id, whatever the file is called.
"""

from __future__ import annotations

import hashlib
import os
import re
import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megatron.core.dmi.records import table_nbytes
from megatron.core.dmi.store import raw_segment
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store.raw_segment import CorruptSegmentError, Quarantined, VerifiedSegment

SEGMENT_RE = re.compile(r"^(?:(?P<kind>[a-z_]+)-(?P<mseq>\d{8})\.parquet|(?P<seq>\d{8})\.(?P<ext>parquet|dmiraw))$")
RAW_EXT = "dmiraw"
RAW_NAME_RE = re.compile(r"^(\d{8})\.dmiraw$")
RANK_DIR_RE = re.compile(r"^rank-(?P<rank>\d{5,})$")
META_ID = b"dmi.segment_id"
META_KIND = b"dmi.kind"
META_VERSION = b"dmi.schema_version"
META_RANK = b"dmi.rank"
META_RUN = b"dmi.run_id"
META_ROWS = b"dmi.rows"  # a Parquet segment's row count, checked on read (with its page CRCs)


def rank_dir(spool_root: str, rank: int) -> str:
    """The spool folder of one rank."""
    return os.path.join(spool_root, f"rank-{rank:05d}")


@dataclass(frozen=True)
class Segment:
    """One spool segment file: its path, the rank that wrote it, its kind and sequence number."""

    path: str
    rank: int
    kind: str
    seq: int

    @property
    def raw(self) -> bool:
        """Whether this is a raw ``.dmiraw`` segment (the native spool writer's) rather than Parquet."""
        return self.path.endswith("." + RAW_EXT)

    @property
    def size(self) -> int:
        """The file's size in bytes (0 once it is gone)."""
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


def unfinished_segments(spool_root: str) -> list[tuple[str, bool]]:
    """(path, writer alive) of every ``.<name>.<pid>.tmp`` file under ``spool_root``'s rank folders: a segment its
    writer had not finished; one whose process is gone was killed mid-write and holds nothing complete (its
    records were never acknowledged; the next run on that rank folder deletes it)."""
    out = []
    for folder, _dirs, files in os.walk(spool_root):
        for name in sorted(files):
            parts = name.split(".")
            if name.startswith(".") and name.endswith(".tmp") and len(parts) >= 4 and parts[-2].isdigit():
                try:
                    os.kill(int(parts[-2]), 0)
                    alive = True
                except ProcessLookupError:
                    alive = False
                except PermissionError:
                    alive = True
                out.append((os.path.join(folder, name), alive))
    return out


def segment_id_of(seg: Segment, metadata: dict | None) -> str:
    if metadata and META_ID in metadata:
        return metadata[META_ID].decode()
    st = os.stat(seg.path)
    return "path:" + hashlib.sha1(f"{os.path.abspath(seg.path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def peek_segment_id(seg: Segment) -> str:
    """The segment's id from its footer (Parquet) or header (raw) alone; raises CorruptSegmentError."""
    if seg.raw:
        return raw_segment.segment_id(raw_segment.read_header(seg.path)[0])
    try:
        md = pq.read_schema(seg.path).metadata
    except (pa.ArrowException, OSError) as e:  # a damaged or truncated file
        raise CorruptSegmentError(f"{seg.path}: unreadable Parquet footer ({type(e).__name__}: {e})") from None
    return segment_id_of(seg, md)


def verify_raw_segment(path: str) -> VerifiedSegment:
    """A ``.dmiraw`` segment's verified records (``raw_segment.verify``) as the tensor table, with
    the segment metadata a Parquet segment carries."""
    header, v = raw_segment.verify(path)
    meta = {
        META_ID: raw_segment.segment_id(header).encode(),
        META_KIND: b"tensors",
        META_VERSION: str(S.SCHEMA_VERSION).encode(),
        META_RANK: str(header.get("rank", "")).encode(),
        META_RUN: str(header.get("run_id", "")).encode(),
    }
    v.table = v.table.replace_schema_metadata(meta)
    return v


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
        except (pa.ArrowException, OSError) as e:  # a damaged or truncated file
            raise CorruptSegmentError(f"{seg.path}: cannot read ({type(e).__name__}: {e})") from None
    return t.num_rows, table_nbytes(t)


def _read_parquet(path: str, payload_pages: bool) -> pa.Table:
    """A Parquet segment, every page's CRC checked; with ``payload_pages=False`` not those of the payload column,
    which the caller checks record by record (the page CRCs halve the read's speed)."""
    if payload_pages:
        return pq.read_table(path, page_checksum_verification=True)
    with pq.ParquetFile(path, page_checksum_verification=True) as checked:
        names = checked.schema_arrow.names
        if "payload" not in names:  # the schema check refuses it
            return checked.read()
        rest = checked.read(columns=[n for n in names if n != "payload"])
    with pq.ParquetFile(path) as unchecked:
        payload = unchecked.read(columns=["payload"]).column("payload")
    return rest.add_column(names.index("payload"), "payload", payload)


def read_segment(seg: Segment, payload_pages: bool = True) -> pa.Table:
    """Read and validate a whole segment against its kind's schema (``payload_pages``: see ``_read_parquet``)."""
    if seg.raw:
        return read_raw_segment(seg.path)
    expected = S.KIND_SCHEMAS[seg.kind]
    try:
        table = _read_parquet(seg.path, payload_pages)
    except (pa.ArrowException, OSError) as e:  # a damaged or truncated file
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
    table = read_segment(seg, payload_pages=seg.kind != "tensors")  # a tensor's payload has its own CRC
    if seg.kind != "tensors" or table.num_rows == 0:
        return VerifiedSegment(table, [], [])
    ok = _payload_checks(table)
    if ok.all():
        return VerifiedSegment(table, [], [])
    keys = table.drop_columns(["payload", "nbytes", "checksum", "shape"]).filter(pa.array(~ok)).to_pylist()
    bad = [Quarantined(int(i), "payload CRC mismatch", k) for i, k in zip(np.flatnonzero(~ok), keys)]
    return VerifiedSegment(table.filter(pa.array(ok)), bad, [])


__all__ = [
    "Segment",
    "list_segments",
    "read_segment",
    "read_raw_segment",
    "segment_rows_bytes",
    "peek_segment_id",
    "CorruptSegmentError",
    "rank_dir",
    "verify_segment",
    "verify_raw_segment",
    "VerifiedSegment",
    "Quarantined",
]
