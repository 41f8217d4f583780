"""Bar chart of step-time overhead per arm (median, 95% bootstrap interval) from overhead.py's JSON.

    python benchmarks/plot_overhead.py benchmarks/results/overhead_h200.json docs/overhead_h200.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    arms = json.load(open(src))["arms"]
    names = [n for n in arms if n not in ("off", "graph_off")]
    over = [arms[n]["overhead_pct"] for n in names]
    err = [[o - arms[n]["ci95"][0] for n, o in zip(names, over)], [arms[n]["ci95"][1] - o for n, o in zip(names, over)]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, over, yerr=err, capsize=4, color=["tab:blue" if "graph" not in n else "tab:purple" for n in names])
    ax.set_yscale("symlog", linthresh=1)
    ax.axhline(1, color="tab:red", lw=0.8, ls="--", label="1 % target")
    ax.axhline(0.5, color="tab:orange", lw=0.8, ls=":", label="0.5 % target")
    ax.set_ylabel("step-time overhead vs its baseline, % (symlog)")
    ax.set_title("DMI on one H200 (median, 95% bootstrap CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
