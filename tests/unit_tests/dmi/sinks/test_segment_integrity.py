"""Spool segments verify themselves (issue 17 item 2): real `.dmiraw` segments from the JIT-built
native writer, real bit flips, cuts and deletions, loaded into real chDB stores (each in its own
process) and through the real CLI. Nothing that fails a check is loaded, everything else is, and
the loss is reported; no damage crashes a reader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.drain import Drain
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.sinks import SpoolSink
from megatron.core.dmi.store.segments import list_segments, read_segment, verify_segment
from megatron.core.dmi.transport.native import NativeRingTransport
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
RUN = "run-int"
BLOCKS, PER_BLOCK = 3, 4  # records blocks per segment as published; the writer may cut them finer
DESCRIPTOR = ("seq", "site", "iteration", "microbatch", "attempt", "phase", "invocation", "nbytes", "crc32")


# -- a decoder that needs nothing but numpy, json and zlib, written from docs/storage.md -----------
def decode_dmiraw(path: str) -> dict:
    """Every block of a format-2 `.dmiraw` segment, each CRC checked, and its records as dicts."""
    buf = open(path, "rb").read()
    out = {"blocks": [], "records": [], "header": None, "footer": None}
    sites, crcs, pos = {}, [], 0
    while pos < len(buf):
        magic = buf[pos : pos + 8]
        a, b, crc = (int(x) for x in np.frombuffer(buf, "<u8", 3, pos + 8))
        body = pos + 32
        covered = {b"DMIRAW02": b + (-b) % 8, b"DMISITE2": b + (-b) % 8, b"DMIRECS2": a * 9 * 8, b"DMIEND02": 16}[magic]
        assert zlib.crc32(buf[body : body + covered], zlib.crc32(buf[pos : pos + 24])) == crc, (magic, pos)
        out["blocks"].append({"magic": magic, "at": pos, "a": a, "b": b})
        if magic == b"DMIEND02":
            blocks, chain = (int(x) for x in np.frombuffer(buf, "<u8", 2, body))
            assert (a, blocks, chain) == (len(out["records"]), len(crcs), zlib.crc32(np.array(crcs, "<u8").tobytes()))
            out["footer"] = {"records": a, "payload_bytes": b}
            pos = body + 16
            break
        crcs.append(crc)
        if magic in (b"DMIRAW02", b"DMISITE2"):
            doc = json.loads(buf[body : body + b])
            if magic == b"DMIRAW02":
                out["header"] = dict(doc, seq=a)
            else:
                sites[a] = doc
            pos = body + b + (-b) % 8
            continue
        rows = np.frombuffer(buf, "<u8", a * 9, body).reshape(a, 9)
        data = body + a * 72
        out["blocks"][-1]["rows_at"] = body
        for row in rows:
            d = dict(zip(DESCRIPTOR, (int(x) for x in row)))
            payload = buf[data : data + d["nbytes"]]
            assert zlib.crc32(payload) == d["crc32"]
            key = dict(
                sites[d["site"]],
                iteration=d["iteration"],
                microbatch=d["microbatch"],
                attempt=d["attempt"],
                invocation=d["invocation"],
                phase=("train", "valid")[d["phase"]],
            )
            out["records"].append({"key": key, "payload": payload})
            data += d["nbytes"]
        pos = body + a * 72 + b + (-b) % 8
    assert pos == len(buf) and out["footer"] is not None
    return out


# -- real segments ---------------------------------------------------------------------------------
def _key(i: int, x: torch.Tensor) -> RecordKey:
    return RecordKey(
        RUN,
        "valid" if i % 5 == 4 else "train",
        1 + i // 4,
        1,
        i % 4,
        0,
        i % 2,
        "router.logits",
        ParallelCoords(rank=0),
        0,
        1,
        0,
        x.shape[0],
        x.shape[0],
        "float32",
        tuple(x.shape),
    )


def native_segments(spool: str, segments: int = 1) -> dict:
    """`segments` closed segments of BLOCKS records blocks of PER_BLOCK records each; returns the
    payloads sent by (phase, iteration, microbatch, layer)."""
    ring = NativeRingTransport(4 << 20, "block", "cpu", block_timeout=DMIConfig.block_timeout)
    sink = SpoolSink(RUN, ParallelCoords(rank=0), spool, segment_bytes=1 << 30)
    drain = Drain(ring, sink, linger_bytes=0)
    assert drain.native
    sent, i = {}, 0
    for _ in range(segments):
        for _ in range(BLOCKS):
            for _ in range(PER_BLOCK):
                x = torch.randn(8 + i, 4)
                k = _key(i, x)
                assert ring.publish(k, x)
                sent[(k.phase, k.iteration, k.microbatch, k.layer)] = x.numpy().tobytes()
                i += 1
            deadline = time.monotonic() + 10
            while ring.spool_stats()["records"] < i and time.monotonic() < deadline:
                time.sleep(0.005)  # one records block per batch
        drain.flush()  # closes the segment
    drain.close()
    ring.close()
    assert sink.close().records_written == i
    return sent


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    spool = str(tmp_path_factory.mktemp("pristine") / "spool")
    sent = native_segments(spool)
    (seg,) = raw_segments(spool)
    return spool, seg.path, sent


def raw_segments(spool: str) -> list:
    return [s for s in list_segments(spool) if s.raw]


def damaged_copy(pristine, tmp_path, damage) -> tuple[str, str]:
    src_spool, src, _ = pristine
    spool = str(tmp_path / "spool")
    shutil.copytree(src_spool, spool)
    path = os.path.join(spool, os.path.relpath(src, src_spool))
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data = damage(data, decode_dmiraw(src))
        f.seek(0)
        f.truncate()
        f.write(data)
    return spool, path


def flip(byte_at: int, bit: int = 0):
    def damage(data, _layout):
        data[byte_at] ^= 1 << bit
        return data

    return damage


def records_blocks(layout) -> list[dict]:
    return [b for b in layout["blocks"] if b["magic"] == b"DMIRECS2"]


def word_of_row(layout, block: int, row: int, column: str) -> int:
    return records_blocks(layout)[block]["rows_at"] + (row * 9 + DESCRIPTOR.index(column)) * 8


def cli(*args) -> tuple[int, str]:
    p = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    return p.returncode, p.stdout + p.stderr


# -- tests -----------------------------------------------------------------------------------------
def test_a_segment_decodes_with_numpy_alone_as_the_reader_reads_it(pristine):
    """docs/storage.md is enough to decode a segment: the same keys and bytes as read_segment."""
    _, path, sent = pristine
    got = decode_dmiraw(path)
    assert got["header"]["run_id"] == RUN and got["header"]["schema_version"] >= 1
    assert [b["magic"] for b in got["blocks"]][:2] == [b"DMIRAW02", b"DMISITE2"]
    assert sum(b["magic"] == b"DMIRECS2" for b in got["blocks"]) >= BLOCKS
    assert got["footer"]["records"] == len(sent) == len(got["records"])
    table = read_segment(raw_segments(os.path.dirname(path))[0]).to_pylist()
    by_key = {(r["phase"], r["iteration"], r["microbatch"], r["layer"]): r for r in table}
    for rec in got["records"]:
        k = rec["key"]
        r = by_key[(k["phase"], k["iteration"], k["microbatch"], k["layer"])]
        assert rec["payload"] == r["payload"] == sent[(k["phase"], k["iteration"], k["microbatch"], k["layer"])]
        assert {n: k[n] for n in ("run_id", "output", "attempt", "invocation", "rank", "dtype")} == {
            n: r[n] for n in ("run_id", "output", "attempt", "invocation", "rank", "dtype")
        }
        assert list(k["shape"]) == r["shape"]


@pytest.mark.parametrize("where", ["phase", "iteration", "attempt", "site"])
def test_a_flipped_descriptor_bit_is_quarantined_and_the_rest_loads(pristine, tmp_path, where):
    """A flip in the first records block's descriptors: that block is quarantined, the blocks
    after it load, nothing moves to a wrong key (before: a wrong iteration, a superseding
    attempt, or an IndexError in every reader for the phase word)."""
    layout = decode_dmiraw(pristine[1])
    before = len(pristine[2]) - records_blocks(layout)[0]["a"]
    spool, path = damaged_copy(pristine, tmp_path, flip(word_of_row(layout, 0, 0, where), 3))
    v = verify_segment(raw_segments(spool)[0])
    assert v.table.num_rows == before and v.problems and v.quarantined[0].row == -1
    out = run_isolated(W.ingest_and_count, str(tmp_path / "store"), spool)
    r = out["result"]
    assert r["segments_partial"] == 1 and r["records"] == before and r["errors"]
    good = {_row(x) for x in out["tensors"]}
    assert len(good) == before and all(k in pristine[2] for k in good)  # only real keys
    assert out["segments"] == [{"status": "partial", "rows": before}]
    assert out["quarantine"] and "fail their CRC" in out["quarantine"][0]["reason"]
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path) + ".corrupt"]  # kept for inspection


def _row(r: dict) -> tuple:
    return r["phase"], r["iteration"], r["microbatch"], r["layer"]


def test_a_flipped_payload_bit_quarantines_that_record_only(pristine, tmp_path):
    layout = decode_dmiraw(pristine[1])
    recs = [b for b in layout["blocks"] if b["magic"] == b"DMIRECS2"]
    first_payload = recs[0]["rows_at"] + recs[0]["a"] * 72
    spool, _ = damaged_copy(pristine, tmp_path, flip(first_payload + 5, 6))
    out = run_isolated(W.ingest_and_count, str(tmp_path / "store"), spool)
    assert out["result"]["records"] == len(pristine[2]) - 1 and out["result"]["records_quarantined"] == 1
    (q,) = out["quarantine"]
    assert q["row"] == 0 and q["reason"] == "payload CRC mismatch" and q["iteration"] == 1
    for r in out["tensors"]:
        assert r["payload"] == pristine[2][_row(r)]


def test_a_segment_cut_at_a_block_boundary_is_reported(pristine, tmp_path):
    """The footer's totals: a segment missing its last block (cut exactly between blocks) loads
    what it holds and says it was cut (before: a block's records short, exit 0)."""

    def cut_last_records_block(data, layout):
        last = [b for b in layout["blocks"] if b["magic"] == b"DMIRECS2"][-1]
        return data[: last["at"]]

    spool, _ = damaged_copy(pristine, tmp_path, cut_last_records_block)
    kept = len(pristine[2]) - records_blocks(decode_dmiraw(pristine[1]))[-1]["a"]
    rc, out = cli("load", spool, "--store", str(tmp_path / "store"))
    assert rc == 1, out
    assert f"{kept} record(s)" in out and "no footer: the segment was cut short" in out, out


def test_a_flipped_header_bit_rejects_the_segment_and_show_does_not_crash(pristine, tmp_path):
    spool, path = damaged_copy(pristine, tmp_path, flip(40))  # inside the header's JSON
    store = str(tmp_path / "store")
    os.makedirs(store)
    shutil.move(spool, os.path.join(store, "spool"))
    rc, out = cli("show", store)
    assert "Traceback" not in out and "damaged raw segment header (CRC mismatch)" in out, out
    assert "1 corrupt segment(s) skipped" in out


def test_show_reports_a_flipped_phase_word_instead_of_crashing(pristine, tmp_path):
    layout = decode_dmiraw(pristine[1])
    spool, _ = damaged_copy(pristine, tmp_path, flip(word_of_row(layout, 0, 1, "phase"), 2))
    store = str(tmp_path / "store")
    os.makedirs(store)
    shutil.move(spool, os.path.join(store, "spool"))
    rc, out = cli("show", store)
    assert rc == 0 and "Traceback" not in out and "IndexError" not in out, out
    kept = len(pristine[2]) - records_blocks(layout)[0]["a"]
    assert "failed verification" in out and f"{kept} verified record(s) kept" in out, out
    assert f"{kept} record(s)" in out and RUN in out, out  # the rest loaded, and show shows the run


def test_a_deleted_segment_is_noticed(tmp_path):
    spool = str(tmp_path / "spool")
    native_segments(spool, segments=3)
    segs = raw_segments(spool)
    assert [s.seq for s in segs] == [1, 2, 3]
    os.unlink(segs[1].path)
    out = run_isolated(W.ingest_and_count, str(tmp_path / "store"), spool)
    assert out["result"]["missing_segments"] == {"rank-00000/00000002.dmiraw"}
    assert any("00000002.dmiraw" in e and "missing" in e for e in out["result"]["errors"])


def _parquet_segment_with_a_flip(tmp_path, find: bytes | None = None, column: str = "") -> str:
    """A Parquet tensor segment of ``W.moe_records()`` with one bit flipped: in the first copy of ``find``, or in
    the last byte of ``column``'s pages."""
    spool = str(tmp_path / "spool")
    sink = SpoolSink(RUN, ParallelCoords(rank=0), spool)
    sink.write(W.moe_records())
    sink.close()
    (seg,) = [s for s in list_segments(spool) if s.kind == "tensors"]
    meta = pq.ParquetFile(seg.path).metadata
    assert meta.metadata[b"dmi.rows"] == str(len(W.moe_records())).encode() and meta.num_row_groups == 1
    if column:
        chunk = meta.row_group(0).column(meta.schema.names.index(column))
        at = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size - 1
    with open(seg.path, "r+b") as f:
        data = bytearray(f.read())
        data[at if column else bytes(data).index(find) + 1] ^= 0x10
        f.seek(0)
        f.write(data)
    return spool


def test_a_flipped_payload_bit_in_a_parquet_segment_quarantines_that_record(tmp_path):
    """A Parquet payload is checked by its record's CRC (not its page's, which would halve the read):
    a flipped payload byte quarantines that record, the rest load (before 2026-12-07: the whole segment
    was refused)."""
    records = W.moe_records()
    spool = _parquet_segment_with_a_flip(tmp_path, records[3].payload)
    out = run_isolated(W.ingest_and_count, str(tmp_path / "store"), spool)
    assert out["result"]["records"] == len(records) - 1 and out["result"]["records_quarantined"] == 1
    (q,) = out["quarantine"]
    assert q["row"] == 3 and q["reason"] == "payload CRC mismatch"
    assert out["result"]["segments_partial"] == 1


def test_a_flipped_key_bit_in_a_parquet_segment_refuses_the_segment(tmp_path):
    """Key columns keep their page CRCs: a flipped byte of a record's key is a corrupt segment, not a wrong key."""
    spool = _parquet_segment_with_a_flip(tmp_path, column="iteration")
    out = run_isolated(W.ingest_and_count, str(tmp_path / "store"), spool)
    assert out["result"]["segments_corrupt"] == 1 and out["result"]["records"] == 0
    assert any("cannot read" in e for e in out["result"]["errors"]), out["result"]["errors"]


def test_format_1_segments_are_refused_with_a_clear_message(pristine, tmp_path):
    spool, path = damaged_copy(pristine, tmp_path, lambda d, _l: bytearray(b"DMIRAW01") + d[8:])
    out = run_isolated(W.ingest_and_count, str(tmp_path / "store"), spool)
    assert out["result"]["segments_corrupt"] == 1
    assert any("format 1" in e and "load it with the release that wrote it" in e for e in out["result"]["errors"])
