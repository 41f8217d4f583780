"""DMI's cost on the training step, resolved to a fraction of a percent by pairing adjacent steps (issue 30).

One process, one model per arm, each with its ``DMISession`` attached for the whole run; the steps
alternate between DMI on and off through the session's per-step switch
(``before_forward(..., capture=False)``), so both halves of a pair run on the same warmed-up process,
allocator and clocks, a step apart. Each round runs, in random order, one *arm pair* (a captured
and an uncaptured step, in random order) and one *A/A pair* (two uncaptured steps): the A/A pairs,
interleaved exactly like the arm pairs, measure the floor below which a difference is noise.

Per pair: 100 * (t_first - t_second) / t_second, with "first" the captured step of an arm pair
(or a random one of an A/A pair). Reported: the 10 %-trimmed mean of the pairs' differences with
a 95 % bootstrap interval (resampling pairs), for

* ``b_router``: hooks ``router`` (4 outputs per MoE layer);
* ``c_router_attn``: hooks ``router,attn``;
* ``aa``: every A/A pair; ``aa_floor_pct`` = the larger end of its interval in absolute value.

A step is forward and backward of one micro-batch (megatron-core MoE GPT, local spec, the model of
``host_cost.py``), with ``--persist none`` (capture and transport, no store; the default) or
``spool`` (the product's path: on a GPU the native spool writer).

    python benchmarks/step_time_paired.py --device cuda --pairs 700 --out benchmarks/results/step_time_paired_<device>.json
    python benchmarks/step_time_paired.py --device cpu --pairs 4 --layers 2 --hidden 64 --seq 64 ...  # smoke scale
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time

import numpy as np
import torch
from host_cost import add_model_args, build_model, finish, init, run_facts  # benchmarks/ is the script directory

from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.session import DMISession

ARMS = {"b_router": "router", "c_router_attn": "router,attn"}
TRIM = 0.10  # share of pairs cut from each end before averaging (a GC pause or a stray sync)


def trimmed_mean(values: np.ndarray) -> float:
    """Mean of ``values`` without the lowest and highest ``TRIM`` share."""
    v = np.sort(values)
    cut = int(len(v) * TRIM)
    return float(v[cut : len(v) - cut].mean()) if len(v) > 2 * cut else float(v.mean())


def interval(diffs: list[float], resamples: int, rng: np.random.Generator) -> dict:
    """The trimmed mean of ``diffs`` and its 95 % bootstrap interval (pairs resampled)."""
    d = np.asarray(diffs, dtype=np.float64)
    boot = [trimmed_mean(rng.choice(d, size=len(d), replace=True)) for _ in range(resamples)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"delta_pct": trimmed_mean(d), "ci95_pct": [float(lo), float(hi)], "pairs": len(d)}


class Stepper:
    """One model with its DMI session attached; ``step(capture)`` times one training step."""

    def __init__(self, a, device: torch.device, hooks: str, store: str):
        """Build the model (same seed for every arm) and attach a session capturing ``hooks``."""
        torch.manual_seed(1234)
        self.device = device
        self.model = build_model(a, device)
        self.model.train()
        config = DMIConfig(hooks=parse_hooks(hooks), persist=a.persist, store_dir=store, ring_mb=a.ring_mb)
        self.session = DMISession(config, device=device, command_line=["step_time_paired.py"])
        self.session.attach(self.model)
        self.ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device=device)
        self.pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.micro_batch, -1)
        self.iteration = 0
        self.records = {True: [], False: []}  # records published per captured / uncaptured step

    def step(self, capture: bool) -> float:
        """One forward and backward, captured or not; its wall seconds (device work included). Python's
        garbage collector is held off while the step is timed (Megatron's --manual-gc does the same for a
        whole run): a collection landing in one step of a pair is noise that only more pairs would average out."""
        self.iteration += 1
        before = self.session.transport.stats.published
        gc.disable()
        try:
            t0 = time.perf_counter()
            self.session.before_forward(self.model, self.iteration, capture=capture)
            loss = self.model(self.ids, self.pos, None, labels=self.ids)
            loss.float().mean().backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        finally:
            gc.enable()
        self.model.zero_grad(set_to_none=True)
        self.session.transport.settle()
        self.records[capture].append(self.session.transport.stats.published - before)
        return seconds

    def close(self) -> None:
        """End the session."""
        self.session.close()


def pct(first: float, second: float) -> float:
    """How much longer ``first`` took than ``second``, in percent of ``second``."""
    return 100.0 * (first - second) / second


def run_arm(stepper: Stepper, a, rng: random.Random, seconds: float) -> tuple[list[float], list[float], list[float]]:
    """``a.pairs`` rounds of one arm pair and one A/A pair in random order, or as many as ``seconds``
    allow; (arm diffs, A/A diffs, off-step seconds)."""
    for _ in range(a.warmup):
        stepper.step(rng.random() < 0.5)
    gc.collect()
    gc.freeze()  # the model's and session's objects: later collections need not walk them
    arm, aa, off = [], [], []
    deadline = time.perf_counter() + seconds
    for _ in range(a.pairs):
        if time.perf_counter() > deadline:
            print(f"time budget reached after {len(arm)} rounds", flush=True)
            break
        for kind in rng.sample(("arm", "aa"), 2):
            if kind == "arm":
                if rng.random() < 0.5:
                    on, other = stepper.step(True), stepper.step(False)
                else:
                    other, on = stepper.step(False), stepper.step(True)
                arm.append(pct(on, other))
                off.append(other)
            else:
                x, y = stepper.step(False), stepper.step(False)
                aa.append(pct(x, y) if rng.random() < 0.5 else pct(y, x))
                off += [x, y]
    return arm, aa, off


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--pairs", type=int, default=700, help="arm pairs per arm (as many A/A pairs go with them)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per arm")
    add_model_args(p)
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--max-seconds", type=float, default=float("inf"), help="stop each arm's rounds after its share of this time"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    if a.pairs < 2:
        p.error("--pairs must be at least 2")

    on_gpu = a.device == "cuda"
    init(on_gpu)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    rng = random.Random(a.seed)
    np_rng = np.random.default_rng(a.seed)
    out: dict = {
        **run_facts(a, device),
        "statistic": f"{TRIM:.0%}-trimmed mean of paired step-time differences, 95% bootstrap interval",
    }
    aa_all: list[float] = []
    off_all: list[float] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as store:
        for name, hooks in ARMS.items():
            stepper = Stepper(a, device, hooks, store)
            try:
                arm, aa, off = run_arm(stepper, a, rng, a.max_seconds / len(ARMS))
            finally:
                stepper.close()
            out[name] = dict(
                interval(arm, a.resamples, np_rng),
                hooks=hooks,
                records_per_captured_step=float(np.median(stepper.records[True])),
                records_per_uncaptured_step=float(np.max(stepper.records[False])),
                aa=interval(aa, a.resamples, np_rng),
            )
            aa_all += aa
            off_all += off
    out["aa"] = interval(aa_all, a.resamples, np_rng)
    out["aa_floor_pct"] = max(abs(v) for v in out["aa"]["ci95_pct"])
    out["step_ms_uncaptured_median"] = 1000 * float(np.median(off_all))
    out["wall_seconds"] = time.perf_counter() - t0
    for name in ("aa", *ARMS):
        r = out[name]
        print(
            f"{name:<16}{r['delta_pct']:>+8.3f} %  95% CI [{r['ci95_pct'][0]:+.3f}, {r['ci95_pct'][1]:+.3f}]  ({r['pairs']} pairs)"
        )
    print(
        f"aa_floor_pct {out['aa_floor_pct']:.3f}; uncaptured step {out['step_ms_uncaptured_median']:.1f} ms; device: {out['device']}"
    )
    finish(a.out, out)


if __name__ == "__main__":
    main()
