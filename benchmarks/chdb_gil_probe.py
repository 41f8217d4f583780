"""Does a chDB query hold the GIL? A pure-Python loop counts its units of work per second alone, then
while another thread runs a CPU-heavy chDB query in an embedded session. If the query held the GIL
the loop would stop for the query's whole duration (the in-process ingester would then stall the
training thread for every insert).

    python benchmarks/chdb_gil_probe.py [--store DIR] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import chdb
import chdb.session
from results_json import write_json  # benchmarks/ is the script directory


def spin(seconds: float) -> float:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = 0
        for i in range(1000):
            x += i
        n += 1
    return n / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None)
    p.add_argument("--rows", type=int, default=400_000_000)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    session = chdb.session.Session(a.store or tempfile.mkdtemp(prefix="chdb_gil_"))
    alone = spin(2.0)
    done, took = threading.Event(), []

    def query() -> None:
        t = time.perf_counter()
        session.query(f"SELECT sum(cityHash64(number)) FROM numbers({a.rows})", "CSV")
        took.append(time.perf_counter() - t)
        done.set()

    threading.Thread(target=query).start()
    during = []
    while not done.is_set():
        during.append(spin(0.25))
    result = {
        "chdb": chdb.__version__,
        "cpus": os.cpu_count(),
        "loop_alone_per_s": alone,
        "loop_during_query_per_s": sum(during) / max(1, len(during)),
        "query_seconds": took[0],
    }
    result["loop_kept_fraction"] = result["loop_during_query_per_s"] / alone
    print(json.dumps(result, indent=1))
    if a.out:
        write_json(a.out, result)


if __name__ == "__main__":
    main()
