"""DMI's host time per hook firing, per output group, clocked directly (issue 22, DESIGN section 10).

An eager MoE step is host-bound, so DMI's host microseconds per firing are its direct cost on the
step. This script builds a megatron-core MoE GPT (local spec) on the GPU, or on the CPU through
DMI's CPU shim, attaches DMI through ``DMISession`` (``--dmi-persist none``: capture and transport,
no store), wraps its sites with ``hook_clock.HookClock`` and runs forward passes:

* ``router``: one router firing (4 outputs: logits, top-k ids and weights, expert counts), DMI's
  time = the wrapper's time minus the router's own routing inside it;
* ``attn``: one core-attention firing (``attn.context``);
* ``not_captured``: the same sites on an iteration DMI does not capture (``--dmi-interval``), per site.

Targets on the H200 host: router <= 100 us, attention <= 40 us, not captured <= 2 us per site. On a
CPU the producer's copy runs on the calling thread (a memcpy), so CPU figures include the copy that
a GPU does asynchronously; the Python part is the same.

    python benchmarks/host_cost.py --out benchmarks/results/host_cost_<device>.json
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import socket
import statistics
import subprocess
import tempfile

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


def clock_group(model, group: str, a, device, store: str) -> dict:
    """Forward passes with one group captured (or, for ``not_captured``, the router and attention
    sites installed but no iteration captured); DMI host seconds per firing by site kind."""
    hooks = "router,attn" if group == "not_captured" else group
    config = DMIConfig(
        hooks=parse_hooks(hooks),
        persist="none",
        store_dir=store,
        ring_mb=a.ring_mb,
        start_iter=NEVER if group == "not_captured" else 1,
    )
    clock = HookClock(model)
    clock.before_attach()
    session = DMISession(config, device=device, command_line=["host_cost.py"])
    session.attach(model)
    clock.after_attach()
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device=device)
    pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.micro_batch, -1)
    samples: dict[str, list[float]] = {}
    gc.collect()
    gc.disable()  # no collection inside a clocked firing
    try:
        with torch.no_grad():
            for step in range(1, a.warmup + a.steps + 1):
                session.before_forward(model, step)
                model(ids, pos, None)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step > a.warmup:
                    for kind, v in clock.samples.items():
                        samples.setdefault(kind, []).extend(v)
                clock.samples.clear()
    finally:
        gc.enable()
    report = session.close()
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--ring-mb", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()

    on_gpu = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    init(on_gpu)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    results: dict = {}
    with tempfile.TemporaryDirectory() as store:
        for group in ("router", "attn", "not_captured"):
            torch.manual_seed(1234)
            model = build_model(a, device)  # a fresh model per group: no clock wraps another's
            model.train()  # phase "train"; forwards run without autograd (no_grad): only the hooks matter
            results[group] = clock_group(model, group, a, device, store)
    out = {
        "device": device_name(device),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "model": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "experts", "topk", "seq", "micro_batch")},
        "steps": a.steps,
        "router.host_us_per_firing": summary(results["router"]["samples"]["router"]),
        "attn.host_us_per_firing": summary(results["attn"]["samples"]["attn"]),
        "not_captured.host_us_per_site": summary([s for v in results["not_captured"]["samples"].values() for s in v]),
        "targets_us": {"router": 100, "attn": 40, "not_captured_per_site": 2},
    }
    print(f"{'what':<32}{'median us':>12}{'p10':>10}{'p90':>10}{'firings':>9}")
    for key in ("router.host_us_per_firing", "attn.host_us_per_firing", "not_captured.host_us_per_site"):
        s = out[key]
        print(f"{key:<32}{s['median']:>12.1f}{s['p10']:>10.1f}{s['p90']:>10.1f}{s['firings']:>9}")
    print(f"device: {out['device']}")
    if a.out:
        write_json(a.out, out)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
