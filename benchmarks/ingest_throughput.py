"""How fast one chDB session takes record payloads, by payload codec, insert threads and record size (issue 33).

Each measurement creates a fresh embedded store with one table ``(k UInt64, payload String
CODEC(<codec>))`` and inserts ``--total-mb`` of bf16 payloads (normal samples, like activations;
barely compressible) in 64 MiB Arrow batches through ``INSERT ... SELECT FROM Python(batch)``,
the statement the embedded backend's ``insert_arrow`` runs, with ``max_insert_threads`` set. It
reports GiB/s of payload and the compression ratio the store reached (``system.columns``). This
is the store's side of ingest alone: no spool reading, checksums or read-back.

    python benchmarks/ingest_throughput.py --codecs 'ZSTD(1)' LZ4 NONE --threads 1 4 8 16 \
        --record-mb 32 4 --total-mb 2048 --json benchmarks/results/ingest_throughput_<host>.json
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
from chdb import session as chs
from results_json import write_json  # benchmarks/ is the script directory

BATCH_MB = 64


def bf16_payload(nbytes: int, rng: np.random.Generator) -> bytes:
    """``nbytes`` of bfloat16 normal samples (the top half of float32's bits)."""
    x = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def measure(root: str, codec: str, threads: int, record_mb: float, total_mb: int, seed: int) -> dict:
    """One fresh store, one codec: GiB/s of payload inserted and the compression ratio reached."""
    rng = np.random.default_rng(seed)
    nbytes = int(record_mb * 2**20)
    pool = [bf16_payload(nbytes, rng) for _ in range(8)]  # distinct payloads: no repeats within a block
    n = max(1, int(total_mb / record_mb))
    per_batch = max(1, int(BATCH_MB / record_mb))
    batches = [
        pa.table(
            {
                "k": pa.array(np.arange(lo, min(n, lo + per_batch), dtype=np.uint64)),
                "payload": pa.array([pool[i % len(pool)] for i in range(lo, min(n, lo + per_batch))], type=pa.binary()),
            }
        )
        for lo in range(0, n, per_batch)
    ]
    path = tempfile.mkdtemp(dir=root)
    session = chs.Session(os.path.join(path, "chdb"))
    try:
        session.query("CREATE DATABASE IF NOT EXISTS bench")
        session.query(f"CREATE TABLE bench.t (k UInt64, payload String CODEC({codec})) ENGINE = MergeTree ORDER BY k")
        t0 = time.perf_counter()
        for batch in batches:
            arrow_rows = batch  # noqa: F841 (read by name by the query)
            session.query(f"INSERT INTO bench.t SELECT * FROM Python(arrow_rows) SETTINGS max_insert_threads={threads}")
        wall = time.perf_counter() - t0
        sizes = str(
            session.query(
                "SELECT sum(data_compressed_bytes), sum(data_uncompressed_bytes) FROM system.columns "
                "WHERE database = 'bench' AND table = 't' AND name = 'payload'",
                "CSV",
            )
        ).strip()
        compressed, uncompressed = (int(v) for v in sizes.split(","))
    finally:
        session.close()
        shutil.rmtree(path, ignore_errors=True)
    return {
        "codec": codec,
        "insert_threads": threads,
        "record_mb": record_mb,
        "payload_mb": n * nbytes / 2**20,
        "GiBps": n * nbytes / 2**30 / wall,
        "ratio": uncompressed / max(compressed, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", nargs="+", default=["ZSTD(1)", "LZ4", "NONE"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--record-mb", nargs="+", type=float, default=[32, 4])
    p.add_argument("--total-mb", type=int, default=1024, help="payload per measurement")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="dmi_ingest_")
    os.makedirs(root, exist_ok=True)
    rows = []
    print(f"{'record MiB':>10} {'codec':>8} {'threads':>7} {'GiB/s':>7} {'ratio':>6}")
    for record_mb in a.record_mb:
        for codec in a.codecs:
            for threads in a.threads:
                r = measure(root, codec, threads, record_mb, a.total_mb, seed=len(rows))
                rows.append(r)
                print(f"{record_mb:>10g} {codec:>8} {threads:>7} {r['GiBps']:>7.3f} {r['ratio']:>6.3f}", flush=True)
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        write_json(
            a.json,
            {"host": platform.node(), "cpus": os.cpu_count(), "args": vars(a), "results": rows},
        )


if __name__ == "__main__":
    main()
