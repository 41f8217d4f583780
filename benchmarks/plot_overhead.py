"""Bar chart of step-time overhead per arm (median, 95% bootstrap interval) from overhead.py's JSON,
one bar group per arm and one bar per result file (label=path; a bare path is labelled by its name).

    python benchmarks/plot_overhead.py docs/overhead_h200.png \
        "python-file writes=benchmarks/results/overhead_h200.json" \
        "arrow-stream writes=benchmarks/results/overhead_h200_arrow_writes.json"
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(dst: str, sources: list[str]) -> None:
    runs = []
    for src in sources:
        label, _, path = src.rpartition("=")
        runs.append((label or os.path.basename(path), json.load(open(path))["arms"]))
    names = []
    for _, arms in runs:
        names += [n for n in arms if n not in ("off", "graph_off") and n not in names]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(runs)
    x = np.arange(len(names))
    for i, (label, arms) in enumerate(runs):
        have = [j for j, n in enumerate(names) if n in arms]
        over = np.array([arms[names[j]]["overhead_pct"] for j in have])
        lo = np.array([arms[names[j]]["ci95"][0] for j in have])
        hi = np.array([arms[names[j]]["ci95"][1] for j in have])
        ax.bar(
            x[have] + (i - (len(runs) - 1) / 2) * width,
            over,
            width,
            yerr=[over - lo, hi - over],
            capsize=3,
            label=label,
        )
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_yscale("symlog", linthresh=1)
    ax.axhline(1, color="tab:red", lw=0.8, ls="--", label="1 % target")
    ax.axhline(0.5, color="tab:orange", lw=0.8, ls=":", label="0.5 % target")
    ax.set_ylabel("step-time overhead vs its baseline, % (symlog)")
    ax.set_title("DMI on one H200 (median, 95% bootstrap CI)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
