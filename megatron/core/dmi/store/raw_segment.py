"""Raw spool segments (``.dmiraw``, format 2) read back with every check: the native writer
(csrc/dmi/spool_writer.h) puts a CRC over every block, one per payload, and a footer with the
segment's totals; the layout is in docs/storage.md. What verifies is returned as the tensor
table, what does not is quarantined, and no damage raises anything but CorruptSegmentError (and
that only for a bad header).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import PHASES, Firing, RecordKey
from megatron.core.dmi.records import DESCRIPTOR_COLUMNS, descriptor_table
from megatron.core.dmi.store import schema as S

# Format 2; format 1 had no CRC over keys and no footer.
RAW_MAGIC, SITE_MAGIC, RECS_MAGIC, END_MAGIC = b"DMIRAW02", b"DMISITE2", b"DMIRECS2", b"DMIEND02"
OLD_RAW_MAGIC = b"DMIRAW01"


class CorruptSegmentError(DMIError, RuntimeError):
    """A spool segment whose header or framing is damaged, or that is not a DMI segment."""


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
        """Whether everything verified: no record quarantined and no problem with the segment."""
        return not self.quarantined and not self.problems

    def summary(self, path: str) -> str:
        """One line for the segment at ``path``: its problems, the records quarantined (with the first reason) and
        the verified records kept."""
        records = [q for q in self.quarantined if q.row >= 0]
        parts = list(self.problems)
        if records:
            parts.append(
                f"{len(records)} record(s) quarantined ({records[0].reason}"
                + (", ..." if len(records) > 1 else "")
                + ")"
            )
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


def read_header(path: str) -> tuple[dict, int]:
    """A raw segment's header (with its ``seq`` and block ``crc``) and where its first block starts."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            magic, seq, n, crc = _HEAD.unpack(head) if len(head) == _HEAD.size else (head[:8], 0, 0, 0)
            if magic == OLD_RAW_MAGIC:
                raise CorruptSegmentError(
                    f"{path}: raw segment of format 1 (written before megatron-dmi checksummed keys); this "
                    f"release reads format 2 only: load it with the release that wrote it"
                )
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


def segment_id(header: dict) -> str:
    """Unique per segment: the writer's id (new at every start) and the segment's number."""
    return f"{header.get('writer_id', 'raw')}-{header['seq']}"


def numbering(path: str) -> tuple[str, int, int]:
    """(writer id, segment number, the writer's first number) from a raw segment's header."""
    header = read_header(path)[0]
    return header.get("writer_id", "raw"), header["seq"], int(header.get("first_seq", header["seq"]))


def writer_of(segment_id: str) -> tuple[str, int] | None:
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


def _records_block(
    sites: dict, rows: np.ndarray, data: pa.Buffer, first_row: int, quarantined: list[Quarantined]
) -> pa.Table | None:
    """The verified records of one records block; the others go to ``quarantined``."""
    nbytes = rows[:, DESCRIPTOR_COLUMNS.index("nbytes")]
    ends = np.cumsum(nbytes)
    good = np.ones(len(rows), dtype=bool)
    mem = memoryview(data)
    for i, row in enumerate(rows):
        site, phase, crc = (int(row[DESCRIPTOR_COLUMNS.index(c)]) for c in ("site", "phase", "crc32"))
        why = (
            "site undefined in this segment"
            if site not in sites
            else f"phase word {phase} out of range"
            if phase >= len(PHASES)
            else "payload CRC mismatch"
            if zlib.crc32(mem[int(ends[i] - nbytes[i]) : int(ends[i])]) != crc
            else None
        )
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


def verify(path: str) -> tuple[dict, VerifiedSegment]:
    """Read a segment, checking every block CRC, every payload CRC and the footer's totals: its
    header and the records that verify (the payload column views the memory-mapped file); the
    rest are quarantined. Raises CorruptSegmentError only when the header itself is bad."""
    header, pos = read_header(path)
    if header.get("schema_version") != S.SCHEMA_VERSION:
        raise CorruptSegmentError(
            f"{path}: raw segment of schema version {header.get('schema_version')}, "
            f"this megatron-dmi loads version {S.SCHEMA_VERSION}"
        )
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
            problems.append(
                f"footer counts {footer[0]} record(s) in {footer[2]} block(s), the segment holds "
                f"{rows_seen} in {len(crcs) - 1}: blocks are missing"
            )
        if pos != buf.size:
            problems.append(f"{buf.size - pos} byte(s) after the footer")
    table = pa.concat_tables(tables) if tables else S.KIND_SCHEMAS["tensors"].empty_table()
    return header, VerifiedSegment(table, quarantined, problems)
