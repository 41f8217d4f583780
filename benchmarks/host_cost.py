"""DMI's host time per hook firing, per output group, clocked directly (issues 22 and 30, DESIGN section 10).

An eager MoE step is host-bound, so DMI's host microseconds per firing are its direct cost on the
step. This script builds a megatron-core MoE GPT (local spec) on the GPU, or on the CPU through
DMI's CPU shim, attaches DMI through ``DMISession`` (``--persist none``: capture and transport, no store;
``--persist spool``: the product's spool path) with one group selected at a time, wraps its sites with ``hook_clock.HookClock`` and runs
passes (forward only; forward and backward for ``grad``):

* ``router``: one router firing (4 outputs: logits, top-k ids and weights, expert counts), DMI's
  time = the wrapper's time minus the router's own routing inside it;
* ``attn``: one core-attention firing (``attn.context``);
* ``resid``, ``mlp``, ``mlp.experts``, ``loss``, ``logits``, ``grad``: one firing of any of the
  group's sites (``grad``: the forward-side hooks and each gradient published in backward);
* ``not_captured``: the router and attention sites on an iteration DMI does not capture, per site.

Targets on the H200 host: router <= 100 us, attention <= 40 us, not captured <= 2 us per site. On a
CPU the producer's copy runs on the calling thread (a memcpy), so CPU figures include the copy that
a GPU does asynchronously; the Python part is the same. ``--profile DIR`` also writes a cProfile of
DMI's own time in each group's passes (``DIR/<group>.txt``: the functions by own time).

    python benchmarks/host_cost.py --out benchmarks/results/host_cost_<device>.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import socket
import statistics
import subprocess
import tempfile
import time

import torch
from hook_clock import HookClock  # benchmarks/ is the script directory
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from results_json import write_json  # benchmarks/ is the script directory

from megatron.core import parallel_state as ps
from megatron.core.dmi import cpu_mode
from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.session import DMISession

NEVER = 10**9  # a start iteration no run reaches: the sites fire, nothing is captured


def init(on_gpu: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if on_gpu:
        torch.cuda.set_device(0)
    else:
        cpu_mode.enable()
    torch.distributed.init_process_group(
        "nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def build_model(a, device: torch.device) -> torch.nn.Module:
    """The MoE GPT; on the GPU in bf16 behind megatron-core's Float16Module (which casts the
    embedding's output to bf16), as training runs it."""
    on_gpu = device.type == "cuda"
    config = TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        ffn_hidden_size=4 * a.hidden,
        num_attention_heads=a.heads,
        num_moe_experts=a.experts,
        moe_router_topk=a.topk,
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        add_bias_linear=False,
        bf16=on_gpu,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(num_experts=a.experts, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=a.vocab, max_sequence_length=a.seq).to(device)
    return Float16Module(config, model) if on_gpu else model


GROUPS = ("router", "attn", "resid", "mlp", "mlp.experts", "loss", "logits", "grad")


def clock_group(model, group: str, a, device, store: str, profile_dir: str | None = None) -> dict:
    """Passes with one group captured (or, for ``not_captured``, the router and attention sites
    installed but no iteration captured); DMI host seconds per firing by group."""
    hooks = "router,attn" if group == "not_captured" else group
    config = DMIConfig(
        hooks=parse_hooks(hooks),
        persist=a.persist,
        store_dir=store,
        ring_mb=a.ring_mb,
        start_iter=NEVER if group == "not_captured" else 1,
    )
    profiler = cProfile.Profile() if profile_dir else None
    clock = HookClock(model, profiler)
    clock.before_attach()
    session = DMISession(config, device=device, command_line=["host_cost.py"])
    session.attach(model)
    clock.after_attach(session)
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device=device)
    pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.micro_batch, -1)
    backward = group == "grad"
    samples: dict[str, list[float]] = {}
    gc.collect()
    gc.disable()  # no collection inside a clocked firing
    try:
        with torch.set_grad_enabled(backward):
            for step in range(1, a.warmup + a.steps + 1):
                timed = step > a.warmup
                session.before_forward(model, step)
                loss = model(ids, pos, None, labels=ids)
                if backward:
                    loss.float().mean().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if timed:
                    for kind, v in clock.samples.items():
                        samples.setdefault(kind, []).extend(v)
                clock.samples.clear()
                model.zero_grad(set_to_none=True)
    finally:
        gc.enable()
    report = session.close()
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(40)
        with open(os.path.join(profile_dir, f"{group}.txt"), "w") as f:
            f.write(f"# {group}: DMI's own time in {a.warmup + a.steps} passes, cProfile by own time\n{out.getvalue()}")
    return {"samples": samples, "published": report.lines[0]}


def summary(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    q = statistics.quantiles(us, n=10) if len(us) > 1 else [us[0]] * 9
    return {"median": statistics.median(us), "p10": q[0], "p90": q[-1], "firings": len(us)}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return f"{model} ({os.cpu_count()} CPUs)"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's size and the ring's (shared with step_time_paired.py)."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--ring-mb", type=float, default=64.0)
    p.add_argument(
        "--persist",
        choices=["none", "spool"],
        default="none",
        help="none: the drain discards in Python; spool: the product's path (the native spool writer on a GPU)",
    )


def host_speed(device: torch.device) -> dict:
    """Yardsticks of the host's own speed, so that figures of two lent hosts can be compared: a fixed
    pure-Python loop (ms, least of 5) and one small in-place torch op on ``device`` (us per call, least of 5;
    on a GPU a kernel launch through the dispatcher)."""

    def least(work, reps: int) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            work()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best

    x = torch.zeros(16, device=device)

    def ops() -> None:
        for _ in range(2000):
            x.add_(1)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return {
        "python_loop_ms": least(lambda: sum(i * i for i in range(200_000)), 1) * 1e3,
        "torch_op_us": least(ops, 2000) * 1e6,
    }


def run_facts(a, device: torch.device) -> dict:
    """What a results JSON names: the device, the code, torch, the model's size and the host's speed."""
    return {
        "device": device_name(device),
        "host_speed": host_speed(device),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "model": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "experts", "topk", "seq", "micro_batch")},
        "persist": a.persist,
    }


def finish(path: str | None, out: dict) -> None:
    """Write the results to ``path`` (if given) and end the process group."""
    if path:
        write_json(path, out)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    add_model_args(p)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--groups", default=",".join(GROUPS), help="comma-separated groups to clock (not_captured always runs)"
    )
    p.add_argument("--profile", default=None, metavar="DIR", help="write a cProfile summary per group into DIR")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    groups = [g for g in a.groups.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        p.error(f"unknown groups {unknown}; choose from {list(GROUPS)}")
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)

    on_gpu = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    init(on_gpu)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    results: dict = {}
    with tempfile.TemporaryDirectory() as store:
        for group in (*groups, "not_captured"):
            torch.manual_seed(1234)
            model = build_model(a, device)  # a fresh model per group: no clock wraps another's
            model.train()  # phase "train"; only grad runs backward, the other groups forward only
            results[group] = clock_group(model, group, a, device, store, a.profile)
    out = {
        **run_facts(a, device),
        "steps": a.steps,
        "not_captured.host_us_per_site": summary([s for v in results["not_captured"]["samples"].values() for s in v]),
        "targets_us": {"router": 100, "attn": 40, "not_captured_per_site": 2},
    }
    for group in groups:
        seconds = results[group]["samples"].get(group, [])
        if seconds:
            out[f"{group}.host_us_per_firing"] = summary(seconds)
            out[f"{group}.host_us_per_step"] = sum(seconds) * 1e6 / a.steps
    print(f"{'what':<36}{'median us':>12}{'p10':>10}{'p90':>10}{'firings':>9}{'us/step':>10}")
    for key in [k for k in out if k.endswith(".host_us_per_firing") or k.endswith(".host_us_per_site")]:
        s = out[key]
        per_step = out.get(key.rsplit(".", 1)[0] + ".host_us_per_step", float("nan"))
        print(f"{key:<36}{s['median']:>12.1f}{s['p10']:>10.1f}{s['p90']:>10.1f}{s['firings']:>9}{per_step:>10.0f}")
    print(f"device: {out['device']}; host speed: {out['host_speed']}")
    finish(a.out, out)


if __name__ == "__main__":
    main()
