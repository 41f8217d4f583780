"""Persistence throughput into the embedded chDB store (payload MB/s), for 64 KiB and 4 MiB records.

Three paths, each on a warm store (schema created and one batch inserted before timing):

- ``insert``:  Arrow batch -> chDB (``load_table``: what the ingester does per batch)
- ``verify``:  reading that batch back (``rows_missing``: its keys and payload CRCs found in the
  store), what the ingester does after every insert; also given as its share of insert + verify
- ``spool``:   records -> Parquet spool segment, fsync'd (what every rank's sink does)
- ``ingest``:  spool segments -> chDB (the per-node ingester: read, verify every CRC, insert, read
  back, bookkeeping)

Payloads are bf16 normal samples (like activations; barely compressible). Prints a table and
writes JSON (``--json``). Usage::

    python benchmarks/persist_throughput.py --total-mb 1024 --repeats 3 --json persist.json

``--from-spool DIR`` measures the ingest path on real captures instead: every tensor segment under
DIR (raw or Parquet, e.g. the spool of a GPU run brought back here) is read, validated and
inserted ``--copies`` times, each copy under shifted iterations so no row collapses into another.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import torch
from results_json import write_json  # benchmarks/ is the script directory

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import Record, records_to_table, table_nbytes
from megatron.core.dmi.sinks import SpoolSink
from megatron.core.dmi.store.backend import ChdbBackend
from megatron.core.dmi.store.ingest import ingest_spool, load_table, rows_missing
from megatron.core.dmi.store.segments import list_segments, read_segment


def make_records(record_bytes: int, n: int, iteration: int, pool: list[bytes]) -> list[Record]:
    elems = record_bytes // 2
    out = []
    for i in range(n):
        key = RecordKey(
            "bench",
            "train",
            iteration,
            1,
            i,
            0,
            i % 32,
            "attn.context",
            ParallelCoords(rank=0),
            0,
            1,
            0,
            elems // 1024,
            elems // 1024,
            "bfloat16",
            (elems // 1024, 1024),
        )
        out.append(Record(key, pool[i % len(pool)]))
    return out


def from_spool(spool: str, copies: int, root: str) -> dict:
    """Ingest throughput of real segments: read + validate + insert, ``copies`` times."""
    segs = [s for s in list_segments(spool) if s.kind == "tensors"]
    if not segs:
        raise SystemExit(f"no tensor spool segments under {spool}")
    backend = ChdbBackend(os.path.join(root, "store", "chdb"))
    backend.ensure_schema()
    try:
        load_table(backend, "tensors", read_segment(segs[0]))  # warm-up (copy 0 of the first segment)
        nbytes = rows = 0
        t0 = time.perf_counter()
        for copy in range(1, copies + 1):
            for seg in segs:
                t = read_segment(seg)
                shifted = pa.compute.add(t.column("iteration"), pa.scalar(copy * 1_000_000, pa.int64()))
                t = t.set_column(t.schema.get_field_index("iteration"), "iteration", shifted)
                load_table(backend, "tensors", t)
                nbytes += table_nbytes(t)
                rows += t.num_rows
        wall = time.perf_counter() - t0
    finally:
        backend.close()
    out = {
        "spool": os.path.abspath(spool),
        "segments": len(segs),
        "raw_segments": sum(s.raw for s in segs),
        "copies": copies,
        "records": rows,
        "payload_bytes": nbytes,
        "ingest_MBps": nbytes / wall / 1e6,
    }
    print(
        f"ingest of {len(segs)} real segment(s) x {copies}: {rows} records, {nbytes / 2**20:.0f} MiB, "
        f"{out['ingest_MBps']:.0f} MB/s"
    )
    return out


def machine(args: argparse.Namespace) -> dict:
    """Where and how the results were measured (the head of the JSON)."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(), "args": vars(args)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mb", type=int, default=512, help="payload per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="65536,4194304", help="record sizes in bytes")
    ap.add_argument("--batch-mb", type=int, default=64, help="records per insert / spool segment, in MiB")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--from-spool", default=None, help="ingest these real spool segments instead of synthetic records")
    ap.add_argument("--copies", type=int, default=10, help="with --from-spool: how many times to ingest them")
    args = ap.parse_args()

    root = args.dir or tempfile.mkdtemp(prefix="dmi_bench_")
    os.makedirs(root, exist_ok=True)
    if args.from_spool:
        try:
            out = from_spool(args.from_spool, args.copies, root)
        finally:
            if not args.dir:
                shutil.rmtree(root, ignore_errors=True)
        if args.json:
            write_json(args.json, {**machine(args), **out})
        return
    backend = ChdbBackend(os.path.join(root, "store", "chdb"))
    backend.ensure_schema()
    results = []
    it = 0
    try:
        for size in [int(s) for s in args.sizes.split(",")]:
            pool = [torch.randn(size // 2).to(torch.bfloat16).view(torch.uint8).numpy().tobytes() for _ in range(8)]
            per_batch = max(1, (args.batch_mb << 20) // size)
            n_batches = max(1, (args.total_mb << 20) // (per_batch * size))
            nbytes = n_batches * per_batch * size
            # warm up: one batch through every path
            it += 1
            load_table(backend, "tensors", records_to_table(make_records(size, per_batch, it, pool)))
            for rep in range(args.repeats):
                tables = []
                for _ in range(n_batches):
                    it += 1
                    tables.append(records_to_table(make_records(size, per_batch, it, pool)))
                t_insert = t_verify = 0.0
                for t in tables:
                    t0 = time.perf_counter()
                    load_table(backend, "tensors", t)
                    t1 = time.perf_counter()
                    assert not rows_missing(backend, "tensors", t).any()
                    t_insert += t1 - t0
                    t_verify += time.perf_counter() - t1

                spool_dir = os.path.join(root, f"spool-{size}-{rep}")
                sink = SpoolSink(
                    "bench",
                    ParallelCoords(rank=0),
                    spool_dir,
                    segment_bytes=args.batch_mb << 20,
                    segment_records=1 << 30,
                    segment_seconds=1e9,
                )
                batches = []
                for _ in range(n_batches):
                    it += 1
                    batches.append(make_records(size, per_batch, it, pool))
                t0 = time.perf_counter()
                for b in batches:
                    batch = DMIConfig.flush_records  # the drain hands over at most this many at a time
                    for i in range(0, len(b), batch):
                        sink.write(b[i : i + batch])
                sink.flush()
                t_spool = time.perf_counter() - t0
                sink.close()

                t0 = time.perf_counter()
                r = ingest_spool(backend, spool_dir, delete=True, max_batch_bytes=args.batch_mb << 20)
                t_ingest = time.perf_counter() - t0
                assert r.payload_bytes == nbytes, (r.payload_bytes, nbytes)
                shutil.rmtree(spool_dir, ignore_errors=True)
                results.append(
                    {
                        "record_bytes": size,
                        "repeat": rep,
                        "payload_bytes": nbytes,
                        "insert_MBps": nbytes / t_insert / 1e6,
                        "verify_MBps": nbytes / t_verify / 1e6,
                        "verify_share": t_verify / (t_insert + t_verify),
                        "spool_MBps": nbytes / t_spool / 1e6,
                        "ingest_MBps": nbytes / t_ingest / 1e6,
                    }
                )
                print(
                    f"  size {size:>8} repeat {rep}: insert {results[-1]['insert_MBps']:7.0f} MB/s  "
                    f"verify {results[-1]['verify_MBps']:7.0f} MB/s ({100 * results[-1]['verify_share']:.1f} %)  "
                    f"spool {results[-1]['spool_MBps']:7.0f} MB/s  ingest {results[-1]['ingest_MBps']:7.0f} MB/s",
                    flush=True,
                )
    finally:
        backend.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    summary = []
    print()
    print(
        f"{'record':>8} | {'payload/run':>11} | {'insert MB/s':>11} | {'verify MB/s':>11} | {'verify %':>8} | "
        f"{'spool MB/s':>10} | {'ingest MB/s':>11}   (medians)"
    )
    print("-" * 98)
    for size in sorted({r["record_bytes"] for r in results}):
        rs = [r for r in results if r["record_bytes"] == size]
        row = {"record_bytes": size, "payload_bytes": rs[0]["payload_bytes"], "repeats": len(rs)}
        for k in ("insert_MBps", "verify_MBps", "verify_share", "spool_MBps", "ingest_MBps"):
            row[k] = statistics.median(r[k] for r in rs)
        summary.append(row)
        label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        print(
            f"{label:>8} | {row['payload_bytes'] / 2**20:8.0f} MiB | {row['insert_MBps']:11.0f} | "
            f"{row['verify_MBps']:11.0f} | {100 * row['verify_share']:7.1f}% | {row['spool_MBps']:10.0f} | "
            f"{row['ingest_MBps']:11.0f}"
        )
    if args.json:
        write_json(args.json, {**machine(args), "summary": summary, "runs": results})


if __name__ == "__main__":
    main()
