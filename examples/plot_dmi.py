"""Plot what a DMI run captured: expert-load heatmaps, the dropped-token rate, an attention pattern.

    python examples/plot_dmi.py dmi_store --out plots/            # latest run
    python examples/plot_dmi.py dmi_store --run my-run --layer 2 --head 0 --out plots/

Writes PNGs:
- ``expert_load.png``: for a few iterations, a layers x experts heatmap of each expert's share of
  the layer's routed tokens (after capacity dropping); a balanced router is a flat colour.
- ``expert_load_over_time.png``: per layer, max/mean expert load over iterations (1 = balanced).
- ``drop_rate.png``: fraction of routed token slots dropped by the capacity factor, per iteration.
- ``router_entropy.png``: normalised routing entropy per layer over iterations (if router.logits).
- ``attention.png``: one head's causal attention pattern (if attn.q and attn.k were captured).
- ``hot_experts.png``: per iteration window, a layers x experts heatmap of the router's choices
  (before dropping): a hot expert is a bright cell (``--window`` iterations per panel).
- ``topn_coverage.png``: per layer, the share of routed slots taken by the N most chosen experts.
- ``routing_predictability.png``: per layer, cosine and Spearman of layer L's router applied to
  layer L-1's resid.in against the actual routing (if router.weight and resid.in were captured).
- ``loss_vs_routing.png``: per layer, the mean loss of tokens with a dropped route (solid) and of
  tokens that kept all routes (dashed) over iterations (if loss.token and router.topk_ids).
- ``grad_norm_<output>.png``: per layer, the gradient's RMS per token over iterations, one file per
  captured gradient (``grad_norm_resid_in.png``, ``grad_norm_attn_context.png``,
  ``grad_norm_router_logits.png``).
- ``grad_norm_experts.png``: for a few iterations, a layers x experts heatmap of each expert's
  share of the router-logit gradient (the router's learning signal towards that expert).
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

import megatron_dmi

matplotlib.use("Agg")
megatron_dmi.register_bare_core()  # reading needs none of megatron-core's package import (seconds, notices)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megatron.core.dmi.errors import DMIError  # noqa: E402
from megatron.core.dmi.reader import open_store  # noqa: E402
from megatron.core.dmi.reader.analyses import (  # noqa: E402
    GRADIENTS,
    grad_norms,
    loss_vs_routing,
    routing_concentration,
    routing_predictability,
)


def _spread(values: list, count: int) -> list:
    """Up to ``count`` of ``values``, evenly spread from the first to the last."""
    return [values[round(float(i))] for i in np.linspace(0, len(values) - 1, min(count, len(values)))]


def _save(fig, path: str) -> list[str]:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _layer_expert_panels(panels, cmap: str, label: str, title: str, path: str) -> None:
    """One layers x experts heatmap per (title, share table) panel, side by side, into ``path``."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (panel_title, share) in zip(axes[0], panels):
        im = ax.imshow(share.values, aspect="auto", cmap=cmap, vmin=0)
        ax.set_title(panel_title)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(share.index)), [str(x) for x in share.index])
        fig.colorbar(im, ax=ax, label=label)
    fig.suptitle(title)
    _save(fig, path)


def plot_expert_load(load, out_dir: str, max_panels: int = 4) -> list[str]:
    its = sorted(load["iteration"].unique())
    if not its:
        return []
    pick = _spread(its, max_panels)
    panels = []
    for it in pick:
        m = load[load.iteration == it].pivot(index="layer", columns="expert", values="tokens_post").fillna(0)
        panels.append((f"iteration {it}", m.div(m.sum(axis=1).replace(0, 1), axis=0)))
    p1 = os.path.join(out_dir, "expert_load.png")
    _layer_expert_panels(panels, "viridis", "share of tokens", "expert load (after capacity dropping)", p1)

    g = load.groupby(["iteration", "layer"])["tokens_post"]
    imb = (g.max() / g.mean().replace(0, np.nan)).reset_index(name="imbalance")
    fig = layer_lines_figure(
        imb, "imbalance", 1, "max / mean tokens per expert", "expert load imbalance", reference=1.0
    )
    return [p1] + _save(fig, os.path.join(out_dir, "expert_load_over_time.png"))


# Hollow markers of different shapes, on top of colour and dash: layers whose lines coincide (e.g.
# every layer at 0 % drops) stay apart, and so do layers 1 and 11 once colours repeat.
_MARKERS = "osD^vP*Xh<>p"
_DASHES = ["-", "--", ":", "-."]


def layer_lines_figure(
    df,
    column: str,
    scale: float,
    ylabel: str,
    title: str,
    ylim=None,
    reference=None,
    x: str = "iteration",
    xlabel: str = "iteration",
    diagonal: bool = False,
):
    """One line per layer of ``column`` over ``x`` (iterations by default): whole-number x ticks, and
    a y axis from 0 (an all-zero series shows as zero on a 0..1 axis, not as noise around it);
    ``diagonal``: a grey line from (0, 0) to the last x at the top of the scale (the uniform
    reference of a coverage curve)."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.get_cmap("tab10" if df["layer"].nunique() <= 10 else "tab20").colors
    for i, (layer, d) in enumerate(df.groupby("layer")):
        ax.plot(
            d[x],
            scale * d[column],
            color=colors[i % len(colors)],
            ls=_DASHES[i // len(colors) % 4],
            marker=_MARKERS[i % len(_MARKERS)],
            markerfacecolor="none",
            ms=5 + (i % 3),
            label=f"layer {layer}",
        )
    if reference is not None:
        ax.axhline(reference, color="grey", lw=0.8, ls="--")
    if diagonal:
        ax.plot([0, df[x].max()], [0, scale], color="grey", lw=0.8, ls="--", label="uniform")
    top = float(np.nanmax(scale * df[column])) if len(df) else 0.0
    ax.set_ylim(*(ylim or (0, top * 1.1 if top > 0 else 1)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def _per_layer_lines(
    df,
    column: str,
    scale: float,
    ylabel: str,
    title: str,
    path: str,
    ylim=None,
    x: str = "iteration",
    xlabel: str = "iteration",
    diagonal: bool = False,
) -> list[str]:
    if df.empty:
        return []
    return _save(
        layer_lines_figure(df, column, scale, ylabel, title, ylim, x=x, xlabel=xlabel, diagonal=diagonal), path
    )


def plot_drop_rate(rate, out_dir: str) -> list[str]:
    return _per_layer_lines(
        rate,
        "drop_rate",
        100,
        "dropped token slots (%)",
        "capacity-factor drops",
        os.path.join(out_dir, "drop_rate.png"),
    )


def plot_entropy(ent, out_dir: str) -> list[str]:
    return _per_layer_lines(
        ent,
        "entropy_normalized",
        1,
        "routing entropy / log(E)",
        "router entropy (1 = uniform, 0 = collapsed)",
        os.path.join(out_dir, "router_entropy.png"),
        ylim=(0, 1.05),
    )


def plot_attention(pattern, title: str, out_dir: str) -> list[str]:
    fig, ax = plt.subplots(figsize=(5, 4.5))
    im = ax.imshow(pattern.numpy(), cmap="magma", aspect="auto")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="attention probability")
    return _save(fig, os.path.join(out_dir, "attention.png"))


def plot_hot_experts(heatmap, out_dir: str, max_panels: int = 4) -> list[str]:
    windows = sorted(heatmap["window_start"].unique())
    pick = _spread(windows, max_panels)
    panels = []
    for start in pick:
        d = heatmap[heatmap.window_start == start]
        panels.append(
            (
                f"iterations {start}-{int(d['window_end'].iloc[0])}",
                d.pivot(index="layer", columns="expert", values="share").fillna(0),
            )
        )
    p = os.path.join(out_dir, "hot_experts.png")
    _layer_expert_panels(panels, "inferno", "share of routed slots", "hot experts (router choices before dropping)", p)
    return [p]


def plot_coverage(coverage, out_dir: str) -> list[str]:
    return _per_layer_lines(
        coverage,
        "coverage",
        100,
        "routed slots covered (%)",
        "top-N coverage",
        os.path.join(out_dir, "topn_coverage.png"),
        x="top_n",
        xlabel="N most chosen experts",
        diagonal=True,
    )


def plot_predictability(table, out_dir: str) -> list[str]:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), squeeze=False)
    for ax, column in zip(axes[0], ("cosine", "spearman")):
        for layer, d in table.groupby("layer"):
            ax.plot(d["iteration"], d[column], marker=".", label=f"layer {layer}")
        ax.set_ylim(-1.05, 1.05)
        ax.set_xlabel("iteration")
        ax.set_ylabel(column)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("routing predictability: layer L's router on layer L-1's input vs actual")
    return _save(fig, os.path.join(out_dir, "routing_predictability.png"))


def plot_loss_vs_routing(table, out_dir: str) -> list[str]:
    fig, ax = plt.subplots(figsize=(7, 4))
    for layer, d in table.groupby("layer"):
        line = ax.plot(d["iteration"], d["loss_dropped"], marker=".", label=f"layer {layer}: a route dropped")[0]
        ax.plot(
            d["iteration"], d["loss_kept"], marker=".", ls="--", color=line.get_color(), label=f"layer {layer}: kept"
        )
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean per-token loss")
    ax.set_title("loss of tokens with dropped vs kept routes")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, os.path.join(out_dir, "loss_vs_routing.png"))


def plot_grad_norms(result, out_dir: str, max_panels: int = 4) -> list[str]:
    written = []
    for output, table in result.layers.groupby("output"):
        written += _per_layer_lines(
            table,
            "rms_per_token",
            1,
            "RMS per token of the gradient",
            f"{output}: gradient norm per layer",
            os.path.join(out_dir, f"grad_norm_{output.removeprefix('grad.')}.png"),
        )
    if not result.experts.empty:
        its = _spread(sorted(result.experts["iteration"].unique()), max_panels)
        panels = [
            (
                f"iteration {it}",
                result.experts[result.experts.iteration == it].pivot(index="layer", columns="expert", values="share"),
            )
            for it in its
        ]
        path = os.path.join(out_dir, "grad_norm_experts.png")
        _layer_expert_panels(panels, "cividis", "share of squared norm", "router-logit gradient per expert", path)
        written.append(path)
    return written


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description="Plot a DMI run (PNG files).")
    ap.add_argument("store", help="store directory or ClickHouse URL")
    ap.add_argument("--run", default=None, help="run id (default: latest)")
    ap.add_argument("--out", default="dmi_plots")
    ap.add_argument(
        "--iteration", type=int, default=None, help="iteration of the attention plot (default: last with attn.q)"
    )
    ap.add_argument("--layer", type=int, default=None, help="layer of the attention plot (default: first with attn.q)")
    ap.add_argument("--head", type=int, default=0)
    ap.add_argument("--microbatch", type=int, default=0)
    ap.add_argument("--no-entropy", action="store_true", help="skip router entropy (decodes every router.logits)")
    ap.add_argument("--window", type=int, default=1, help="captured iterations per hot-expert panel")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    written: list[str] = []
    with open_store(args.store) as store:
        run = store.resolve_run(args.run)
        desc = store.describe(run)
        outputs = set(desc.outputs["output"]) if not desc.outputs.empty else set()
        if "router.expert_counts" in outputs:
            written += plot_expert_load(store.expert_load(run), args.out)
            written += plot_drop_rate(store.drop_rate(run, by_layer=True), args.out)
            concentration = routing_concentration(store, run, window=args.window)
            written += plot_hot_experts(concentration.heatmap, args.out)
            written += plot_coverage(concentration.coverage, args.out)
            if {"router.weight", "resid.in"} <= outputs:
                written += plot_predictability(routing_predictability(store, run), args.out)
        if {"loss.token", "router.topk_ids"} <= outputs:
            written += plot_loss_vs_routing(loss_vs_routing(store, run), args.out)
        if outputs & set(GRADIENTS):
            written += plot_grad_norms(grad_norms(store, run), args.out)
        if "router.logits" in outputs and not args.no_entropy:
            written += plot_entropy(store.router_entropy(run, progress=True), args.out)
        if {"attn.q", "attn.k"} <= outputs:
            q = desc.outputs[(desc.outputs.output == "attn.q") & (desc.outputs.phase == "train")].iloc[0]
            it = args.iteration if args.iteration is not None else int(q["last_iteration"])
            layer = args.layer if args.layer is not None else int(q["layers"][0])
            pat = store.attention_pattern(run, it, args.microbatch, layer, args.head)
            written += plot_attention(pat, f"run {run} iteration {it} layer {layer} head {args.head}", args.out)
    for p in written:
        print(p)
    if not written:
        print("nothing to plot: the run captured no router.expert_counts, router.logits or attn.q/attn.k")
    return written


if __name__ == "__main__":
    try:
        main()
    except DMIError as e:  # a wrong path or run: the message names it and the way out, no traceback
        sys.exit(f"error: {e}")
