"""Host time of one capture through the ``dmi::ring_capture`` custom op against the same capture
called on the native ring directly (issue 19: "the producer path used in training is the
``torch.library`` op ... or DESIGN is changed with the measured reason").

Both publish the same small tensor into the same native ring under one site; the difference is
what the op's dispatch (torch's dispatcher, the Python custom-op wrapper, the handle lookup) adds
per firing, the figure an eager MoE step (host-bound) pays in step time.

    python benchmarks/op_dispatch_cost.py [--device cuda] [--out results.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import torch
from results_json import write_json  # benchmarks/ is the script directory

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import dtype_name
from megatron.core.dmi.transport import ops
from megatron.core.dmi.transport.native import NativeRingTransport


def site_key(t: torch.Tensor) -> RecordKey:
    return RecordKey(
        "bench", "train", 0, 0, 0, 0, 0, "attn.context", ParallelCoords(), 0, 1, 0, t.shape[0], t.shape[0],
        dtype_name(t.dtype), tuple(t.shape),
    )  # fmt: skip


def empty(ring: NativeRingTransport) -> None:
    """Take every record published so far, so the next block starts with room."""
    ring.sync_drain(10.0)
    while ring.pending() > 0:
        ring.take(1 << 20, 0.05)


def per_call_us(fn, calls: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed block")
    p.add_argument("--repeats", type=int, default=15, help="timed blocks per path (median reported)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    tensor = torch.randn(64, 16, device=device)
    ring = NativeRingTransport(64 << 20, "drop", device, block_timeout=DMIConfig.block_timeout)
    site = ring.register_site(site_key(tensor))
    direct = lambda: ring.publish_site(site, tensor)  # noqa: E731
    through_op = lambda: ops.capture(ring, site, tensor)  # noqa: E731
    results = {}
    gc.disable()
    try:
        for name, fn in (("direct", direct), ("custom_op", through_op)) * 2:  # interleaved, twice
            for _ in range(200):  # warm up, and keep the ring from filling: drain between blocks
                fn()
            empty(ring)
            samples = []
            for _ in range(a.repeats):
                samples += per_call_us(fn, a.calls, 1)
                empty(ring)
            results.setdefault(name, []).extend(samples)
    finally:
        gc.enable()
        ring.close()
    summary = {name: statistics.median(v) for name, v in results.items()}
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "direct_us_per_call": summary["direct"],
        "custom_op_us_per_call": summary["custom_op"],
        "op_overhead_us_per_call": summary["custom_op"] - summary["direct"],
    }
    print(json.dumps(out, indent=1))
    if a.out:
        write_json(a.out, out)


if __name__ == "__main__":
    main()
