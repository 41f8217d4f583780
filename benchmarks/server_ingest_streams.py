"""How fast the ingester loads a spool into a ClickHouse server, by insert streams (issue 33 item 5).

A ``SpoolSink`` spools ``--total-mb`` of bf16 records (normal samples, like activations) of ``--record-kb``
into Parquet segments of ``--segment-mb`` (not timed). Then, for each ``--streams`` value, ``ingest_spool``
loads the whole spool into a fresh database of the local test server (``tests/fault_tests/chdb_server.py``:
ClickHouse's HTTP interface in front of chDB, a process of its own on this machine) with that many streams and
batches of ``--batch-mb``: every batch is inserted over HTTP (clickhouse-connect's Arrow insert) and read back,
as the training's ingester does. Reported per run: GiB/s of payload, the CPU seconds per GiB of the ingesting
process (reading and verifying segments, Arrow encoding, HTTP, read-back) and of the server process, the pass's
seconds by stage (``IngestResult.seconds``; insert and read_back summed over the streams), and the machine's
load average before (the machine is shared: the figures depend on it). With ``--url`` it loads into that
ClickHouse server instead (its password from ``$DMI_CLICKHOUSE_PASSWORD``; databases ``bench_streams_<n>`` are
created there, and the server's CPU is not measured): how many streams a node needs, on the training host (a
node's ingester makes ``--dmi-ingest-threads`` inserts at once into a server).

    python benchmarks/server_ingest_streams.py --total-mb 512 --streams 1 2 4 \
        --json benchmarks/results/server_ingest_streams_<host>.json
    python benchmarks/server_ingest_streams.py --url http://clickhouse.internal:8123 --total-mb 4096 --streams 1 2 4 8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: the test server and the record helpers

from results_json import write_json  # noqa: E402  (benchmarks/ is the script directory)

from megatron.core.dmi.key import ParallelCoords  # noqa: E402
from megatron.core.dmi.sinks import SpoolSink  # noqa: E402
from megatron.core.dmi.store.backend import ServerBackend  # noqa: E402
from megatron.core.dmi.store.ingest import ingest_spool  # noqa: E402
from tests.fault_tests.chdb_server import ChdbServer  # noqa: E402
from tests.unit_tests.dmi.sinks import workers as W  # noqa: E402


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def process_cpu_seconds(pid: int) -> float:
    """CPU time of another process so far (its /proc stat: user + system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spool(root: str, total_mb: float, record_kb: int, segment_mb: float, seed: int) -> int:
    """Write the spool; returns its payload bytes."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, int(total_mb * 1024 / record_kb))
    sink = SpoolSink(W.RUN, ParallelCoords(rank=0), os.path.join(root, "spool"), writers=1)
    sink.segment_bytes = int(segment_mb * 2**20)
    sink.segment_records = 1 << 30
    sink.write_run(W.run_info())
    per_layer = record_kb * 1024 // 2
    for i in range(n):
        x = torch.randn(per_layer, generator=g).to(torch.bfloat16)
        sink.write([W.rec("attn.context", x, iteration=1 + i // 16, layer=i % 16)])
    sink.close()
    return n * per_layer * 2


def measure(url: str, server_pid: int | None, spool_root: str, payload: int, streams: int, batch_mb: float) -> dict:
    """One pass over the whole spool into a fresh database (``server_pid``: the server's process, when local)."""
    backend = ServerBackend(url, database=f"bench_streams_{streams}")
    backend.ensure_schema()
    load = os.getloadavg()[0]
    server_cpu = (lambda: process_cpu_seconds(server_pid)) if server_pid else (lambda: 0.0)
    c0, s0, t0 = cpu_seconds(), server_cpu(), time.perf_counter()
    r = ingest_spool(
        backend, spool_root, known=set(), streams=streams, max_batch_bytes=int(batch_mb * 2**20), delete=False
    )
    wall = time.perf_counter() - t0
    cpu, server_s = cpu_seconds() - c0, server_cpu() - s0
    backend.close()
    gib = payload / 2**30
    return {
        "streams": streams,
        "batch_mb": batch_mb,
        "payload_mb": payload / 2**20,
        "records": r.records,
        "errors": r.errors[:1],
        "GiBps": gib / wall,
        "ingester_cpu_s_per_GiB": cpu / gib,
        "server_cpu_s_per_GiB": server_s / gib if server_pid else None,
        "ingester_cores": cpu / wall,
        "server_cores": server_s / wall if server_pid else None,
        "seconds": {k: round(v, 3) for k, v in r.seconds.items()},
        "wall_s": wall,
        "load_before": load,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total-mb", type=float, default=512)
    p.add_argument("--record-kb", type=int, default=1024)
    p.add_argument("--segment-mb", type=float, default=32)
    p.add_argument("--batch-mb", type=float, default=32)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=1, help="runs of each streams value, interleaved")
    p.add_argument("--url", default=None, help="a ClickHouse server to load into (default: the local test server)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="server-streams-") as root:
        payload = spool(root, a.total_mb, a.record_kb, a.segment_mb, seed=0)
        runs = []
        with contextlib.ExitStack() as stack:
            server = None if a.url else stack.enter_context(ChdbServer(os.path.join(root, "server")))
            url, pid = (a.url, None) if a.url else (server.url, server.proc.pid)
            for rep in range(a.repeat):
                for streams in a.streams:
                    row = measure(url, pid, os.path.join(root, "spool"), payload, streams, a.batch_mb)
                    row["repeat"] = rep
                    runs.append(row)
                    print(
                        f"streams {streams}: {row['GiBps']:.3f} GiB/s, ingester {row['ingester_cpu_s_per_GiB']:.1f} "
                        f"CPU-s/GiB ({row['ingester_cores']:.2f} cores), server "
                        + (
                            f"{row['server_cpu_s_per_GiB']:.1f} CPU-s/GiB ({row['server_cores']:.2f} cores)"
                            if pid
                            else "not measured"
                        )
                        + f", stages {row['seconds']}, load {row['load_before']:.1f}",
                        flush=True,
                    )
    if a.json:
        write_json(
            a.json,
            {
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "server": "the local test server (chDB behind tests/fault_tests/chdb_server.py)"
                if not a.url
                else "--url",
                "args": vars(a),
                "runs": runs,
                "payload": "bf16 normal samples (barely compressible)",
                "codec": "LZ4 (the store default)",
            },
        )


if __name__ == "__main__":
    main()
