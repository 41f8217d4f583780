"""Step-time overhead of DMI on one GPU, arms interleaved round after round (DESIGN.md section 10).

A megatron-core MoE GPT (local spec, bf16) trains with a fused AdamW; each round runs every arm
for a block of steps, timed with CUDA events:

  off          DMI off
  off_again    DMI off again, a block of its own (an A/A control): how far two identical arms land
               apart in this benchmark, the floor under which an overhead cannot be told from zero
  router       --dmi-hooks router, native ring, spooled by its C++ writer (everything persisted)
  router_attn  --dmi-hooks router,attn, native ring, spooled by its C++ writer
  router_attn_py  the same with the Python consumer (take_table + Parquet writer threads)
  router_attn_shm  router_attn spooled to /dev/shm (memory: no disk writeback, fsync is free), to
               tell the disk's share of (c)'s cost from the rest of the persist path
  sync_cpu     plain forward hooks doing synchronous .cpu() of the same tensors
  pinned       plain forward hooks copying to pinned buffers on a side stream (persists nothing)
  torch_ring   router,attn through DMI's pure-PyTorch transport, spooled

Each round starts one arm later than the one before (rotation), with a garbage collection before
every block (untimed). Then a dense model whose whole forward+backward is captured in a CUDA graph, with and without DMI's
attention-context producers inside the graph (gate + context set before every replay; the dense
model has no router, so this is router_attn's capture under graphs):

  graph_off, graph_dmi

Prints a table and writes JSON:  python benchmarks/overhead.py --out results.json [--quick]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import gzip
import os
import resource
import shutil
import socket
import statistics
import threading
import time

import numpy as np
import torch
from hook_clock import HookClock  # benchmarks/ is the script directory
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from results_json import write_json  # benchmarks/ is the script directory
from torch.autograd import DeviceType

from megatron.core import parallel_state as ps
from megatron.core.dmi.capture import GATE_ORIGINAL, Capture
from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.drain import Drain
from megatron.core.dmi.hooks import HookSet
from megatron.core.dmi.hooks.install import rank_coords
from megatron.core.dmi.sinks import SpoolSink
from megatron.core.dmi.transport.native import NativeRingTransport
from megatron.core.dmi.transport.torch_ring import TorchRingTransport

MOE_ARMS = (
    "off",
    "off_again",
    "router",
    "router_attn",
    "router_attn_py",
    "router_attn_shm",
    "sync_cpu",
    "pinned",
    "torch_ring",
)
SHM_SPOOL = "/dev/shm/dmi_bench_spool"
GRAPH_ARMS = ("graph_off", "graph_dmi")
GRAPH_HOOKS = "attn"


def init_distributed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def build_model(a: argparse.Namespace, moe: bool) -> GPTModel:
    config = TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        ffn_hidden_size=a.ffn,
        num_attention_heads=a.heads,
        num_moe_experts=a.experts if moe else None,
        moe_router_topk=a.topk,
        moe_ffn_hidden_size=a.moe_ffn if moe else None,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(num_experts=a.experts if moe else None)
    model = GPTModel(config, spec, vocab_size=a.vocab, max_sequence_length=a.seq, position_embedding_type="rope")
    return Float16Module(config, model.cuda())  # bf16 params, fp32 logits: how Megatron wraps it


class DMIArm:
    """DMI as the training integration wires it, minus Megatron's loop: spool sink, drain, hooks."""

    def __init__(
        self,
        model,
        hooks: str,
        transport: str,
        a,
        spool_root: str,
        native_spool: bool = True,
        clock: HookClock | None = None,
    ):
        self.config = DMIConfig(hooks=parse_hooks(hooks), ring_mb=a.ring_mb, persist="spool")
        cls = NativeRingTransport if transport == "native" else TorchRingTransport
        self.transport = cls(
            self.config.ring_bytes,
            self.config.on_full,
            torch.device("cuda", 0),
            block_timeout=self.config.block_timeout,
        )
        self.sink = SpoolSink(f"bench-{hooks}-{transport}", rank_coords(), spool_root)
        self.drain = Drain(self.transport, self.sink, self.config.flush_records, native_spool=native_spool)
        self.capture = Capture(self.config, self.transport, self.sink.run_id, 1)
        self.hooks = HookSet(self.capture)
        if clock:
            clock.before_attach()
        self.hooks.attach(model)
        if clock:
            clock.after_attach()
        self.iteration = 0
        self.keep_spool = a.keep_spool
        self.cpu_start = thread_cpu_seconds()
        self.wall_start = time.perf_counter()

    def step(self) -> None:
        self.iteration += 1
        self.capture.begin_step("train", self.iteration)
        self.capture.set_microbatch(0)

    def detach(self) -> None:
        self.hooks.remove()

    def close(self) -> dict:
        t0 = time.perf_counter()
        self.drain.flush()
        flush_s = time.perf_counter() - t0
        writer = self.transport.spool_stats() if self.drain.native else None
        # CPU of DMI's threads over this arm, sampled before they exit: the Python drain and spool
        # writers by name; "native" (unnamed C++ threads: the ring's drain, checksum helpers, and
        # NCCL's, idle on one GPU) as a delta.
        cpu = thread_cpu_seconds()
        dmi_cpu = {k: v for k, v in cpu.items() if k.startswith("dmi-")}
        dmi_cpu["native"] = cpu.get("native", 0.0) - self.cpu_start.get("native", 0.0)
        wall = time.perf_counter() - self.wall_start
        self.drain.close()
        self.transport.close()
        report = self.sink.close()
        if not self.keep_spool:  # a full run spools more than the GPU machine's disk holds
            shutil.rmtree(self.sink.spool_root, ignore_errors=True)
        s = self.transport.stats
        return {
            "published": s.published,
            "published_bytes": s.published_bytes,
            "dropped": s.dropped,
            "blocked": s.blocked,
            "blocked_seconds": s.blocked_seconds,
            "persisted": report.records_written,
            "persisted_bytes": report.bytes_written,
            "sink_dropped": report.records_dropped,
            "sink_errors": len(report.errors),
            "final_flush_s": flush_s,
            "drain_batches": self.drain.batches_written,
            "native_spool_rounds": int(self.drain.native),
            "dmi_thread_cpu_s": sum(dmi_cpu.values()),
            "arm_wall_s": wall,
            # the C++ writer's wall time in checksums, page-cache writes and fsyncs: next to
            # arm_wall_s it says how close the writer runs to falling behind capture
            **(
                {f"writer_{k[:-3]}_s": writer[k] / 1e9 for k in ("checksum_ns", "write_ns", "sync_ns")}
                if writer
                else {}
            ),
        }


class PlainHooks:
    """What a careful user writes by hand: forward hooks on the same modules (router decisions and
    attention context), either synchronous .cpu() or pinned copies on a side stream."""

    def __init__(self, model, mode: str):
        self.mode = mode
        self.stream = torch.cuda.Stream()
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.handles = []
        for m in model.modules():
            if isinstance(m, TopKRouter):
                self.handles.append(m.register_forward_hook(self.router_hook))
            if hasattr(m, "self_attention"):
                self.handles.append(m.self_attention.core_attention.register_forward_hook(self.attn_hook))

    def copy(self, key, t: torch.Tensor) -> None:
        if self.mode == "sync_cpu":
            t.detach().cpu()
            return
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            buf.copy_(t.detach(), non_blocking=True)
        t.record_stream(self.stream)

    def router_hook(self, module, args, output):
        probs, routing_map = output
        self.copy((id(module), 0), probs)
        self.copy((id(module), 1), routing_map)

    def attn_hook(self, module, args, output):
        self.copy((id(module), 2), output)

    def detach(self) -> None:
        for h in self.handles:
            h.remove()


def batch(a):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.mbs, a.seq), device="cuda", generator=g)
    pos = torch.arange(a.seq, device="cuda").unsqueeze(0).expand(a.mbs, a.seq)
    return ids, pos


def train_step(model, opt, ids, pos) -> None:
    loss = model(ids, pos, attention_mask=None, labels=ids).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def timed(fn, host_ms: list | None = None) -> float:
    """GPU time of fn in ms (CUDA events); appends the host time to enqueue it to ``host_ms``: when
    the host takes as long as the GPU, the step is launch-bound and any CPU stall adds to it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    if host_ms is not None:
        host_ms.append((time.perf_counter() - t0) * 1000)
    end.synchronize()
    return start.elapsed_time(end)


def bootstrap_ci(xs, base, n=2000, seed=0) -> tuple[float, float, float]:
    """Overhead of median(xs) over median(base) in percent, with a 95% bootstrap interval."""
    rng = np.random.default_rng(seed)
    xs, base = np.asarray(xs), np.asarray(base)
    point = (np.median(xs) / np.median(base) - 1) * 100
    samples = [
        (np.median(rng.choice(xs, xs.size)) / np.median(rng.choice(base, base.size)) - 1) * 100 for _ in range(n)
    ]
    return float(point), float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))


def paired_ci(xs, base, block: int, n=2000, seed=0) -> tuple[float, float, float]:
    """Overhead in percent from the rounds: each round's block median over the baseline's block
    median in the same round (adjacent in time, so slow drift of the GPU cancels), then the median
    over rounds with a 95% bootstrap interval over rounds."""
    rounds = min(len(xs), len(base)) // block
    if rounds < 2:
        return float("nan"), float("nan"), float("nan")
    ratios = np.array(
        [
            np.median(xs[r * block : (r + 1) * block]) / np.median(base[r * block : (r + 1) * block])
            for r in range(rounds)
        ]
    )
    rng = np.random.default_rng(seed)
    samples = [np.median(rng.choice(ratios, rounds)) for _ in range(n)]
    return tuple(
        float((v - 1) * 100) for v in (np.median(ratios), np.percentile(samples, 2.5), np.percentile(samples, 97.5))
    )


def thread_cpu_seconds() -> dict[str, float]:
    """CPU time of this process's DMI threads (Python-named ones; the native drain is a C++ thread)."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "native")
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def run_moe(a, spool_root: str) -> tuple[dict, dict]:
    model = build_model(a, moe=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids, pos = batch(a)
    for _ in range(3):
        train_step(model, opt, ids, pos)
    times = {arm: [] for arm in a.arms}
    host = {arm: [] for arm in a.arms}
    totals: dict[str, dict] = {}
    t_start = time.perf_counter()
    for rnd in range(a.rounds):
        if a.moe_seconds and time.perf_counter() - t_start > a.moe_seconds:
            print(f"stopping after {rnd} rounds (--moe-seconds {a.moe_seconds:.0f})", flush=True)
            break
        # Each round starts one arm later, so no arm always follows the same one (a slow teardown,
        # page-cache writeback) or always runs first in a round.
        first = rnd % len(a.arms)
        for arm in a.arms[first:] + a.arms[:first]:
            gc.collect()  # the previous arm's garbage is collected here, not inside a timed step
            dmi = plain = None
            if arm in ("router", "router_attn", "router_attn_py", "router_attn_shm", "torch_ring"):
                hooks = "router" if arm == "router" else "router,attn"
                dmi = DMIArm(
                    model,
                    hooks,
                    "torch" if arm == "torch_ring" else "native",
                    a,
                    SHM_SPOOL if arm == "router_attn_shm" else spool_root,
                    native_spool=arm != "router_attn_py",
                )
            elif arm in ("sync_cpu", "pinned"):
                plain = PlainHooks(model, arm)
            for i in range(a.warmup + a.steps):
                if dmi:
                    dmi.step()
                host_ms = []
                ms = timed(lambda: train_step(model, opt, ids, pos), host_ms)
                if i >= a.warmup:
                    times[arm].append(ms)
                    host[arm].extend(host_ms)
            if plain:
                torch.cuda.synchronize()
                plain.detach()
            if dmi:
                dmi.detach()
                stats = dmi.close()
                acc = totals.setdefault(arm, {})
                for k, v in stats.items():
                    acc[k] = acc.get(k, 0) + v
        print(
            f"round {rnd + 1}/{a.rounds}: " + "  ".join(f"{k} {statistics.median(v):.1f}" for k, v in times.items()),
            flush=True,
        )
    for arm, xs in host.items():
        totals.setdefault(arm, {})["host_enqueue_median_ms"] = statistics.median(xs)
    for arm in ("router", "router_attn"):
        if arm in a.arms and a.hook_clock_rounds:
            totals[arm].update(clock_hooks(a, model, opt, ids, pos, arm, spool_root))
    profiles = {}
    if a.profile_steps:
        try:
            profiles = profile_arms(a, model, opt, ids, pos, spool_root)
        except Exception as exc:  # the A/B results above are kept; say what failed
            profiles = {"error": repr(exc)}
            print(f"profile failed: {profiles['error']}", flush=True)
    return times, totals, profiles


def clock_hooks(a, model, opt, ids, pos, arm: str, spool_root: str) -> dict:
    """DMI's host time per step for one arm, in extra blocks outside the A/B samples (the clocks
    themselves cost a few microseconds per call)."""
    per_step, calls = [], 0
    for _ in range(a.hook_clock_rounds):
        gc.collect()
        clock = HookClock(model)
        dmi = DMIArm(model, "router" if arm == "router" else "router,attn", "native", a, spool_root, clock=clock)
        for i in range(a.warmup + a.steps):
            dmi.step()
            timed(lambda: train_step(model, opt, ids, pos))
            if i >= a.warmup:
                calls += clock.calls
                per_step.append(clock.take_ms())
            else:
                clock.take_ms()
        dmi.detach()
        dmi.close()
    return {
        "dmi_hook_host_ms_median": statistics.median(per_step),
        "dmi_hook_host_ms_samples": per_step,
        "dmi_hook_calls_per_step": calls / len(per_step),
    }


def kernel_summary(prof, steps: int) -> dict:
    """Per step: time the GPU ran any kernel or copy (union of intervals), DMI's own kernels, the
    device-to-host copies (the ring's drain), and the heaviest kernels and host ops."""
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in device)
    busy_us, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy_us += hi - max(lo, end)
            end = hi
    by_name: dict[str, float] = collections.Counter()
    for e in device:
        by_name[e.name] += e.time_range.elapsed_us()
    per_step = lambda us: us / 1000 / steps  # noqa: E731
    host = sorted(prof.key_averages(), key=lambda k: k.self_cpu_time_total, reverse=True)[:12]
    return {
        "device_busy_ms_per_step": per_step(busy_us),
        "dmi_kernel_ms_per_step": per_step(sum(v for k, v in by_name.items() if "dmi::" in k)),
        "dtoh_copy_ms_per_step": per_step(sum(v for k, v in by_name.items() if "DtoH" in k)),
        "top_device_ms_per_step": {k: per_step(v) for k, v in by_name.most_common(12)},
        "top_host_self_ms_per_step": {k.key: per_step(k.self_cpu_time_total) for k in host},
    }


def profile_arms(a, model, opt, ids, pos, spool_root: str) -> dict:
    """torch.profiler over a few steps of off and router_attn: how much of the step the GPU is busy
    (host-bound when well under 100 %) and what DMI's kernels and copies cost on the device."""
    out_dir = os.path.dirname(os.path.abspath(a.out)) if a.out else None
    result = {}
    for arm in ("off", "router_attn"):
        gc.collect()
        dmi = DMIArm(model, "router,attn", "native", a, spool_root) if arm != "off" else None
        for _ in range(a.warmup + 1):
            if dmi:
                dmi.step()
            timed(lambda: train_step(model, opt, ids, pos))
        step_ms = []
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(a.profile_steps):
                if dmi:
                    dmi.step()
                step_ms.append(timed(lambda: train_step(model, opt, ids, pos)))
        if dmi:
            dmi.detach()
            dmi.close()
        result[arm] = {"step_ms_under_profiler": step_ms, **kernel_summary(prof, a.profile_steps)}
        result[arm]["device_busy_pct"] = result[arm]["device_busy_ms_per_step"] / statistics.median(step_ms) * 100
        if out_dir:
            trace = os.path.join(out_dir, f"profile_{arm}.json")
            prof.export_chrome_trace(trace)
            with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
            os.remove(trace)
        print(
            f"profile {arm}: step {statistics.median(step_ms):.1f} ms, GPU busy"
            f" {result[arm]['device_busy_ms_per_step']:.1f} ms, DMI kernels {result[arm]['dmi_kernel_ms_per_step']:.3f} ms,"
            f" DtoH copies {result[arm]['dtoh_copy_ms_per_step']:.2f} ms per step",
            flush=True,
        )
    return result


def run_graphs(a, spool_root: str) -> tuple[dict, dict]:
    """Whole forward+backward of a dense model in one torch CUDA graph, with and without DMI."""
    # Attention forks megatron's RNG tracker: under capture it must use graph-safe generators.
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    model = build_model(a, moe=False)
    ids, pos = batch(a)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def fwd_bwd():
        model(ids, pos, attention_mask=None, labels=ids).float().mean().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    graphs = {"graph_off": torch.cuda.CUDAGraph()}
    with torch.cuda.graph(graphs["graph_off"]):
        fwd_bwd()
    dmi = DMIArm(model, GRAPH_HOOKS, "native", a, spool_root)
    dmi.capture.graphs = True  # the producers go into the graph, gated on the device at each replay
    dmi.capture.begin_step("train", 0)  # inactive step: eager firings would be skipped; capture ignores it
    graphs["graph_dmi"] = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graphs["graph_dmi"]):
        fwd_bwd()
    dmi.detach()
    times = {arm: [] for arm in GRAPH_ARMS}
    replays = 0
    for _rnd in range(a.graph_rounds or a.rounds):
        for arm in GRAPH_ARMS:
            gc.collect()
            for i in range(a.warmup + a.steps):
                if arm == "graph_dmi":
                    replays += 1
                    dmi.transport.set_gate_word(GATE_ORIGINAL)
                    dmi.transport.set_context(iteration=replays, microbatch=0, attempt=1, phase="train", invocation=0)
                ms = timed(graphs[arm].replay)
                if i >= a.warmup:
                    times[arm].append(ms)
    # Gate closed: a replay must publish nothing.
    dmi.transport.set_gate_word(0)
    graphs["graph_dmi"].replay()
    torch.cuda.synchronize()
    stats = dmi.close()
    stats["replays_with_gate_open"] = replays
    stats["expected_records"] = replays * a.layers * len(parse_hooks(GRAPH_HOOKS))
    stats["rejected"] = dmi.transport.stats.rejected
    return times, {"graph_dmi": stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--moe-ffn", type=int, default=2048)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per arm per round")
    p.add_argument(
        "--moe-seconds", type=float, default=0, help="start no new MoE round after this long (0: all rounds)"
    )
    p.add_argument("--graph-rounds", type=int, default=0, help="rounds of the graph arms (0: --rounds)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per arm per round")
    p.add_argument("--ring-mb", type=float, default=512)
    p.add_argument("--spool", default="/tmp/dmi_bench_spool")
    p.add_argument("--keep-spool", action="store_true", help="keep spooled segments (tens of GB) after each arm")
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    p.add_argument("--skip-graphs", action="store_true")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=2,
        help="steps of off and router_attn under torch.profiler after the rounds (0: none); traces go next to --out",
    )
    p.add_argument(
        "--hook-clock-rounds",
        type=int,
        default=3,
        help="extra blocks of router and router_attn with DMI's host time clocked (0: none)",
    )
    p.add_argument("--arms", default=",".join(MOE_ARMS), help="MoE arms to run (off is always run)")
    a = p.parse_args()
    a.arms = ["off"] + [x for x in a.arms.split(",") if x and x != "off"]
    unknown = sorted(set(a.arms) - set(MOE_ARMS))
    if unknown:
        p.error(f"unknown --arms {unknown}; choose from {', '.join(MOE_ARMS)}")
    if a.quick:
        a.layers, a.hidden, a.ffn, a.heads, a.experts, a.moe_ffn, a.seq, a.vocab, a.rounds, a.steps = (
            2,
            256,
            512,
            4,
            8,
            256,
            256,
            1024,
            2,
            2,
        )
    init_distributed()
    t0 = time.perf_counter()
    NativeRingTransport(1 << 20, "block", torch.device("cuda", 0), block_timeout=DMIConfig.block_timeout).close()
    jit_first_s = time.perf_counter() - t0
    cpu0 = thread_cpu_seconds()
    wall0 = time.perf_counter()
    times, totals, profiles = run_moe(a, os.path.join(a.spool, "moe"))
    moe_wall = time.perf_counter() - wall0
    cpu1 = thread_cpu_seconds()
    extra = {
        "jit_first_construct_s": jit_first_s,
        "moe_phase_wall_s": moe_wall,
        "thread_cpu_s_during_moe": {k: cpu1.get(k, 0) - cpu0.get(k, 0) for k in cpu1},
        "graph_error": None,
        "profile": profiles,
    }
    write_result(a, times, totals, extra)  # the MoE arms are kept even if the graph arms run out of time
    if not a.skip_graphs:
        try:
            gtimes, gtotals = run_graphs(a, os.path.join(a.spool, "graphs"))
            times.update(gtimes)
            totals.update(gtotals)
        except Exception as exc:  # keep the MoE results; say what failed
            extra["graph_error"] = repr(exc)
            print(f"graph arms failed: {extra['graph_error']}", flush=True)
        write_result(a, times, totals, extra)


def write_result(a, times: dict, totals: dict, extra: dict) -> dict:
    """Print the table and write the JSON (called after each phase)."""
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "args": vars(a),
        **extra,
        "peak_hbm_gib": torch.cuda.max_memory_allocated() / 2**30,
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "pinned_staging_gib_per_native_transport": a.ring_mb / 1024,
        "arms": {},
    }
    for arm, xs in times.items():
        base = times["graph_off" if arm.startswith("graph") else "off"]
        over, lo, hi = bootstrap_ci(xs, base)
        paired, plo, phi = paired_ci(xs, base, a.steps)
        entry = {
            "median_ms": statistics.median(xs),
            "n": len(xs),
            "overhead_pct": over,
            "ci95": [lo, hi],
            "paired_overhead_pct": paired,
            "paired_ci95": [plo, phi],
            "samples_ms": xs,
        }
        entry.update(totals.get(arm, {}))
        if entry.get("arm_wall_s"):
            entry["dmi_cores_used"] = entry["dmi_thread_cpu_s"] / entry["arm_wall_s"]
        if entry.get("writer_write_s") is not None:
            entry["writer_busy_fraction"] = (entry["writer_checksum_s"] + entry["writer_write_s"]) / entry["arm_wall_s"]
        if "dmi_hook_host_ms_median" in entry:  # the direct cost on a host-bound step's critical path
            entry["dmi_hook_host_pct_of_off"] = entry["dmi_hook_host_ms_median"] / statistics.median(base) * 100
        result["arms"][arm] = entry
    for arm in ("router_attn", "graph_dmi"):
        c = result["arms"].get(arm, {})
        if c.get("persisted_bytes"):
            timed_s = sum(times[arm]) / 1000
            result[f"{arm}_persisted_gb_per_s_of_step_time"] = c["persisted_bytes"] / 1e9 / timed_s
    print(
        f"\n{'arm':12} {'median ms':>10} {'overhead %':>11} {'95% CI':>17} {'paired %':>9} {'paired CI':>17}"
        f" {'records':>9} {'dropped':>8}"
    )
    for arm, e in result["arms"].items():
        print(
            f"{arm:12} {e['median_ms']:10.2f} {e['overhead_pct']:11.2f} [{e['ci95'][0]:6.2f}, {e['ci95'][1]:6.2f}]"
            f" {e['paired_overhead_pct']:9.2f} [{e['paired_ci95'][0]:6.2f}, {e['paired_ci95'][1]:6.2f}]"
            f" {e.get('persisted', '-'):>9} {e.get('dropped', '-'):>8}",
            flush=True,
        )
    for arm, e in result["arms"].items():
        if "dmi_hook_host_ms_median" in e:
            print(
                f"{arm}: DMI host time in hooks {e['dmi_hook_host_ms_median']:.3f} ms/step"
                f" ({e['dmi_hook_host_pct_of_off']:.3f} % of off), {e['dmi_hook_calls_per_step']:.0f} hook calls/step",
                flush=True,
            )
    if a.out:
        write_json(a.out, result)
    return result


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
