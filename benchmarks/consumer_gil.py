"""How much the native ring's consumer (``take_table``) costs a Python thread that never blocks,
which is what the training thread is while it launches kernels (host build, CPU only).

Each pass publishes 16 records of 32 MiB into a host ring, then times ``take_table`` draining them
on a background thread while the main thread spins in Python. Reported per pass: consumer GB/s and
the main thread's speed relative to spinning alone. Passes alternate with a bare ``take_into``
(copy + CRC in C++ only) to separate the C++ work from the Python around it, and with the native
spool writer (a C++ thread writing raw segments; no Python consumer thread at all). On a small VM the two
threads also share cores, so compare variants with each other, not with 100 %.

    python benchmarks/consumer_gil.py [--passes 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import threading
import time

import torch
from results_json import write_json  # benchmarks/ is the script directory

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.transport.native import NativeRingTransport

RECORDS, RECORD_MB = 16, 32
VARIANTS = ("take_into", "take_table", "native_spool")


def spin_rate(seconds: float = 1.0) -> float:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            n += 1
    return n / seconds


def one_pass(ring: NativeRingTransport, variant: str, alone: float) -> dict:
    x = torch.randn(RECORD_MB << 18)
    key = RecordKey(
        "bench", "train", 1, 0, 0, 0, 0, "attn.context", ParallelCoords(), 0, 1, 0, 1, 1, "float32", tuple(x.shape)
    )
    for i in range(RECORDS):
        ring.publish(dataclasses.replace(key, microbatch=i), x)
    if variant == "native_spool":  # the ring's C++ writer consumes (and writes the file) meanwhile
        return spin_while(ring.pending, variant, alone)
    ring.sync_drain()  # staged first: the pass times the Python consumer alone

    def consume():
        while ring.pending():
            if variant == "take_table":
                ring.take_table(1024, 0.01)
            else:
                lease = ring.blobs.lease()
                ring._ring.take_into(1024, 0.01, lease.address, lease.nbytes)

    consumer = threading.Thread(target=consume)
    consumer.start()
    return spin_while(consumer.is_alive, variant, alone)


def spin_while(busy, variant: str, alone: float) -> dict:
    """Spin in Python while ``busy()``; the consumer's rate and this thread's relative speed."""
    t0 = time.perf_counter()
    n = 0
    while busy():
        for _ in range(100):
            n += 1
    wall = time.perf_counter() - t0
    return {"variant": variant, "consumer_gb_s": RECORDS * RECORD_MB / 1024 / wall, "main_speed": n / wall / alone}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ring = NativeRingTransport(
        (RECORDS * RECORD_MB << 20) + (1 << 20), "block", "cpu", block_timeout=DMIConfig.block_timeout
    )
    spooled = NativeRingTransport(
        (RECORDS * RECORD_MB << 20) + (1 << 20), "block", "cpu", block_timeout=DMIConfig.block_timeout
    )
    with tempfile.TemporaryDirectory() as spool_dir:
        spooled.start_spool(spool_dir, {"kind": "tensors"}, 1, 256 << 20, 32 << 20)
        alone = spin_rate()
        rows = [one_pass(spooled if v == "native_spool" else ring, v, alone) for _ in range(a.passes) for v in VARIANTS]
        spooled.stop_spool()
    spooled.close()
    rows = rows[len(VARIANTS) :]  # the first round warms memory (first-touch page faults are slow on VMs)
    for r in rows:
        print(
            f"{r['variant']:10s} consumer {r['consumer_gb_s']:.2f} GB/s, main thread at {r['main_speed']:.0%} of alone"
        )
    summary = {
        v: {k: statistics.median(r[k] for r in rows if r["variant"] == v) for k in ("consumer_gb_s", "main_speed")}
        for v in VARIANTS
    }
    print("medians:", json.dumps(summary))
    if a.json:
        write_json(a.json, {"passes": rows, "medians": summary})


if __name__ == "__main__":
    main()
