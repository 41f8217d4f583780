"""DMI's cost per call of one hook site, the model's own work taken out (issue 30).

``host_cost.py`` clocks DMI's sites inside whole forwards; this script isolates one site. It builds
the ``host_cost.py`` model (smaller by default: the wrapper, not the copy, is what is clocked),
runs one forward to keep the inputs and outputs of layer 0's ``TopKRouter.routing`` and core
attention, then replaces the model's own routing and attention by stubs that return those outputs.
Calling the router's ``routing`` and the core-attention module in a tight loop then costs the call,
plus DMI's wrapper or forward hook when a session is attached. Three arms, alternated in blocks
(each block attaches a fresh ``DMISession`` with ``--persist``):

* ``off``: no session (the call and, for attention, torch's module call);
* ``uncaptured``: a session attached, its step not captured (``start_iter`` never reached);
* ``captured``: a session capturing every step (the firing publishes; on a CPU the copy is a memcpy).

Per site and arm: microseconds per call (median and least of the blocks), DMI's share (the arm
minus ``off``, medians), and per firing the Python and C function calls the training thread makes
(``sys.setprofile``, which sees this thread only; the drain's thread is not counted) and the
largest transient Python allocation (``tracemalloc``); counts do not depend on the host's load.
On a GPU, ``--op-counts`` adds, per captured firing, the torch operators and CUDA runtime calls
(kernel launches, copies, events) the firing makes, counted by ``torch.profiler`` over 50 firings:
what a firing costs in native calls, which a slower host's Python speed does not change.

    python benchmarks/site_cost.py --device cpu --out benchmarks/results/site_cost_cpu2.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch
from host_cost import add_model_args, build_model, finish, init, run_facts  # benchmarks/ is the script directory
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.router import TopKRouter

from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.session import DMISession

NEVER = 10**9  # a start iteration no run reaches
ARMS = {"uncaptured": NEVER, "captured": 1}


class Sites:
    """Layer 0's router and core attention, their own work replaced by stubs returning a real
    forward's outputs; ``calls`` are the two sites' calls as a forward makes them."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor):
        """Run one forward of ``model`` to keep the sites' inputs and outputs, then install the stubs."""
        self.router = next(m for m in model.modules() if isinstance(m, TopKRouter))
        self.attention = next(m for m in model.modules() if isinstance(m, DotProductAttention))
        kept = {}
        routing = self.router.routing

        def keep_routing(logits, *args, **kwargs):
            out = routing(logits, *args, **kwargs)
            kept.setdefault("routing", ((logits, *args), kwargs, out))
            return out

        def keep_attention(module, args, kwargs, output):
            kept.setdefault("attention", (args, kwargs, output))

        self.router.routing = keep_routing
        handle = self.attention.register_forward_hook(keep_attention, with_kwargs=True)
        with torch.no_grad():
            model(ids, pos, None, labels=ids)
        handle.remove()
        self.routing_args, self.routing_kwargs, routed = kept["routing"]
        self.attention_args, self.attention_kwargs, attended = kept["attention"]
        self.routing_stub = lambda *args, **kwargs: routed
        self.router.routing = self.routing_stub
        self.attention.forward = lambda *args, **kwargs: attended
        self.calls = {
            "router": lambda: self.router.routing(*self.routing_args, **self.routing_kwargs),
            "attn": lambda: self.attention(*self.attention_args, **self.attention_kwargs),
        }

    def restub(self) -> None:
        """Put the routing stub back (a session's close removes the instance attribute DMI wrapped)."""
        self.router.routing = self.routing_stub


def per_call_us(call, n: int) -> float:
    """Microseconds per call of ``n`` calls, garbage collection off."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        gc.enable()


def per_firing_counts(call, n: int = 50) -> dict:
    """Python and C function calls of this thread per call, and the largest transient Python allocation of one call."""
    events = {"call": 0, "c_call": 0}

    def count(frame, event, arg):
        if event in events:
            events[event] += 1

    sys.setprofile(count)
    try:
        for _ in range(n):
            call()
    finally:
        sys.setprofile(None)
    gc.disable()
    tracemalloc.start()
    try:
        call()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        call()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()
    return {"python_calls": events["call"] / n, "c_calls": events["c_call"] / n, "peak_alloc_bytes": peak}


def per_firing_ops(call, n: int = 50) -> dict[str, float]:
    """Torch operators and CUDA runtime calls per call, by name, most frequent first (the profiler's CPU-side events)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    counted: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU and event.name != "cudaDeviceSynchronize":
            counted[event.name] = counted.get(event.name, 0) + 1
    return {name: k / n for name, k in sorted(counted.items(), key=lambda kv: -kv[1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    add_model_args(p)
    # small records: the site's own cost, not the producer's copy, is what this clocks
    # and the product's path, whose consumer is the native spool writer: no Python thread beside the
    # training thread allocates or takes the GIL while the counts are taken
    p.set_defaults(layers=2, hidden=64, heads=4, seq=16, micro_batch=1, persist="spool")
    p.add_argument("--hooks", default="router,attn", help="the sessions' --dmi-hooks")
    p.add_argument("--calls", type=int, default=2000, help="calls per site, arm and block (captured: a third)")
    p.add_argument("--blocks", type=int, default=5, help="blocks of the three arms, alternated")
    p.add_argument(
        "--op-counts", action="store_true", help="on a GPU: torch operators and CUDA calls per captured firing"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()

    on_gpu = a.device == "cuda"
    init(on_gpu)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    torch.manual_seed(1234)
    model = build_model(a, device)
    model.train()
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device=device)
    pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.micro_batch, -1)
    sites = Sites(model, ids, pos)
    us: dict[tuple[str, str], list[float]] = {}
    counts: dict[str, dict] = {}

    def run_arm(arm: str, store: str, n: int, count: bool) -> None:
        session = None
        if arm != "off":
            config = DMIConfig(
                hooks=parse_hooks(a.hooks), persist=a.persist, store_dir=store, ring_mb=a.ring_mb, start_iter=ARMS[arm]
            )
            session = DMISession(config, device=device, command_line=["site_cost.py"])
            session.attach(model)
            session.before_forward(model, 1)
        try:
            with torch.no_grad():
                for site, call in sites.calls.items():
                    for _ in range(20):  # warm: the site's record keys and handles are made on its first firing
                        call()
                    us.setdefault((site, arm), []).append(per_call_us(call, n))
                    if count:
                        counts[f"{site}.{arm}"] = per_firing_counts(call)
                        if a.op_counts and on_gpu and arm == "captured":
                            counts[f"{site}.{arm}"]["ops_per_firing"] = per_firing_ops(call)
                    if on_gpu:
                        torch.cuda.synchronize()
        finally:
            if session is not None:
                session.close()
                sites.restub()

    with tempfile.TemporaryDirectory() as store:
        for block in range(a.blocks):
            for arm in ("off", *ARMS):
                run_arm(arm, store, a.calls // 3 if arm == "captured" else a.calls, count=block == 0)
    out = {**run_facts(a, device), "hooks": a.hooks, "blocks": a.blocks, "calls": a.calls}
    print(f"{'site.arm':<20}{'us/call':>10}{'least':>10}{'DMI us':>10}{'py calls':>10}{'C calls':>9}{'peak B':>9}")
    for site in sites.calls:
        off = statistics.median(us[(site, "off")])
        for arm in ("off", *ARMS):
            median = statistics.median(us[(site, arm)])
            entry = {"us_per_call": median, "blocks_us": us[(site, arm)], **counts[f"{site}.{arm}"]}
            if arm != "off":
                entry["dmi_us_per_call"] = median - off
            out[f"{site}.{arm}"] = entry
            print(
                f"{site + '.' + arm:<20}{median:>10.2f}{min(us[(site, arm)]):>10.2f}{entry.get('dmi_us_per_call', 0.0):>10.2f}"
                f"{entry['python_calls']:>10.1f}{entry['c_calls']:>9.1f}{entry['peak_alloc_bytes']:>9}"
            )
    for key, entry in out.items():
        if isinstance(entry, dict) and "ops_per_firing" in entry:
            listed = ", ".join(f"{name} {k:g}" for name, k in list(entry["ops_per_firing"].items())[:25])
            print(f"{key} per firing: {listed}")
    print(f"device: {out['device']}; host speed: {out['host_speed']}")
    finish(a.out, out)


if __name__ == "__main__":
    main()
