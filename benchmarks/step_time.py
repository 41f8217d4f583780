"""Analyse what benchmarks/step_time_h200.sh brought back: Megatron's own "elapsed time per
iteration" with DMI on and off, paired inside one process, and DMI's host time per firing.

Inside one process (``--dmi-interval 2``: odd iterations captured, even ones not), each captured
iteration is paired with the uncaptured one after it; the DMI-off run's odd/even pairs, taken the
same way, are the A/A control. Reported per pairing: the mean paired difference in percent of the
pair's mean, with a bootstrap 95 % confidence interval. ``aa_floor_pct`` is the A/A interval's
largest absolute bound: an overhead smaller than that cannot be told from zero by this run.

    python benchmarks/step_time.py DIR --out benchmarks/results/step_time_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import re

import numpy as np

_STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
_REPORT = re.compile(r"rank 0: captured (\d+) records \((\d+) B\), written (\d+).*?spooled (\d+), dropped (\d+)")
_LAG = re.compile(r"store lag: (\d+) records(?:, (\d+) s)?")
_COMPLETE = re.compile(r"store complete ([0-9.]+) s after close began")
_LOADED = re.compile(r"loaded \d+ segment\(s\): (\d+) record\(s\)")
_WALL = re.compile(r"load rc=(\d+) wall ([0-9.]+) s")


def step_times(log: str) -> dict[int, float]:
    """Iteration -> elapsed ms, as Megatron printed it (--log-interval 1)."""
    return {int(m.group(1)): float(m.group(2)) for m in _STEP.finditer(log)}


def bootstrap_mean_ci(values: np.ndarray, rounds: int = 20000, seed: int = 0) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    means = rng.choice(values, size=(rounds, len(values)), replace=True).mean(axis=1)
    return float(values.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired(times: dict[int, float], skip: int) -> dict:
    """Odd iteration i against even i + 1, in percent of the pair's mean."""
    diffs = [
        100.0 * (times[i] - times[i + 1]) / ((times[i] + times[i + 1]) / 2)
        for i in sorted(times)
        if i > skip and i % 2 == 1 and i + 1 in times
    ]
    if len(diffs) < 3:
        return {"pairs": len(diffs)}
    mean, lo, hi = bootstrap_mean_ci(np.array(diffs))
    return {"pairs": len(diffs), "mean_pct": mean, "ci95_pct": [lo, hi]}


def median_ms(times: dict[int, float], skip: int) -> float | None:
    kept = [t for i, t in times.items() if i > skip]
    return float(np.median(kept)) if kept else None


def read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def analyse(d: str, skip: int) -> dict:
    logs = {
        name: read(os.path.join(d, name + ".log"))
        for name in ("off", "off2", "alt_router", "alt_attn", "router", "spool", "clickhouse")
    }
    times = {name: step_times(log) for name, log in logs.items()}
    out: dict = {"device": read(os.path.join(d, "gpu.txt")).strip(), "skipped_warmup_iterations": skip}
    aa = paired(times["off"], skip)
    out["aa"] = aa
    if "ci95_pct" in aa:
        out["aa_floor_pct"] = max(abs(aa["ci95_pct"][0]), abs(aa["ci95_pct"][1]))
    out["in_process"] = {"router": paired(times["alt_router"], skip), "router_attn": paired(times["alt_attn"], skip)}
    out["median_step_ms"] = {name: median_ms(t, skip) for name, t in times.items()}
    off = out["median_step_ms"]["off"]
    out["separate_runs_vs_off_pct"] = {
        name: 100.0 * (ms / off - 1.0) for name, ms in out["median_step_ms"].items() if ms and off and name != "off"
    }
    for name in ("router", "spool", "clickhouse"):
        m = _REPORT.search(logs[name])
        lags = _LAG.findall(logs[name])
        if m:
            captured, nbytes, written, spooled, dropped = map(int, m.groups())
            out[name] = {
                "captured": captured,
                "captured_bytes": nbytes,
                "written": written,
                "spooled": spooled,
                "dropped": dropped,
                "store_lag_last_log_line": int(lags[-1][0]) if lags else None,
                "store_lag_seconds_last_log_line": int(lags[-1][1]) if lags and lags[-1][1] else None,
            }
            complete = _COMPLETE.search(logs[name])
            if complete:
                out[name]["store_complete_s_after_close_began"] = float(complete.group(1))
    load = read(os.path.join(d, "load.log"))
    spool_bytes = read(os.path.join(d, "spool_bytes.txt")).split()
    wall, loaded = _WALL.search(load), _LOADED.search(load)
    if wall and loaded and spool_bytes:
        out["ingest"] = {
            "records": int(loaded.group(1)),
            "spool_bytes": int(spool_bytes[0]),
            "seconds": float(wall.group(2)),
            "GB_per_s": int(spool_bytes[0]) / float(wall.group(2)) / 1e9,
        }
    host = read(os.path.join(d, "host_cost_h200.json"))
    if host:
        h = json.loads(host)
        out["host_cost"] = h
        for key in ("router.host_us_per_firing", "attn.host_us_per_firing", "not_captured.host_us_per_site"):
            if key in h:
                out[key] = h[key]["median"]
        if off and "router.host_us_per_firing" in out and "attn.host_us_per_firing" in out:
            layers = h["model"][
                "layers"
            ]  # host_cost.py ran the step-time model: one router and one attention firing per layer
            r, a = out["router.host_us_per_firing"], out["attn.host_us_per_firing"]
            out["dmi_host_pct_of_step"] = {
                "router": 100.0 * layers * r / 1000.0 / off,
                "router_attn": 100.0 * layers * (r + a) / 1000.0 / off,
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="the folder with off.log, alt_router.log, ... (the device call's $OUT)")
    p.add_argument("--skip", type=int, default=6, help="warm-up iterations left out (default 6)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result = analyse(a.dir, a.skip)
    text = json.dumps(result, indent=1, sort_keys=True)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
