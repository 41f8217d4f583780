"""Routing analyses computed from a store alone (no training command line, no model).

- ``routing_concentration``: how concentrated routing is on a few experts — per-layer expert
  frequency, a hot-expert heatmap (layer x expert per window of iterations) and top-N coverage
  curves. Needs ``router.expert_counts`` only (the SQL summary table: no payload is decoded), so it
  works on runs captured under CUDA graphs too.
- ``routing_predictability``: can layer L's routing be predicted one layer ahead? Layer L's router
  weight (``router.weight``) is applied to layer L-1's input (``resid.in``); the per-expert
  distribution of the predicted top-k is compared with the router's actual choices at layer L
  (``router.expert_counts`` row 0, before capacity dropping) by cosine similarity and Spearman
  rank correlation, per iteration and layer.

- ``loss_vs_routing``: are the tokens whose routes the capacity factor dropped harder? The mean
  per-token loss (``loss.token``, weighted by its loss mask) of tokens that lost at least one of
  their top-k routes (``router.topk_ids`` holds the sentinel E) against tokens that kept all of
  them, per iteration and layer.

- ``grad_norms``: where does the training signal go? The L2 norms of the captured gradients
  (``grad.resid_in``, ``grad.attn_context``, ``grad.router_logits``) per layer and iteration, and of
  each expert's column of ``grad.router_logits`` (the router's learning signal towards that expert).

The first two count the router's choices before capacity dropping: they describe what the router
wants, not what the capacity factor lets through (``Store.drop_rate`` covers that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from megatron.core.dmi.reader.reconstruct import descending_order
from megatron.core.dmi.reader.store import Store, StoreError


@dataclass
class RoutingConcentration:
    """``frequency``: layer, expert, tokens, share (of the layer's routed slots, all iterations);
    ``heatmap``: window_start, window_end, layer, expert, tokens, share (per iteration window);
    ``coverage``: layer, top_n, coverage (share of the layer's routed slots taken by its top_n most
    chosen experts, n = 1..E)."""

    frequency: pd.DataFrame
    heatmap: pd.DataFrame
    coverage: pd.DataFrame


def _share(df: pd.DataFrame, by: list[str]) -> pd.Series:
    total = df.groupby(by)["tokens"].transform("sum")
    return (df["tokens"] / total.where(total > 0)).fillna(0.0)


def routing_concentration(
    store: Store,
    run_id: str | None = None,
    phase: str = "train",
    layers: Sequence[int] | None = None,
    iterations: Sequence[int] | None = None,
    window: int = 1,
) -> RoutingConcentration:
    """Expert frequency, hot-expert heatmap per ``window`` captured iterations, top-N coverage."""
    if window < 1:
        raise StoreError(f"window must be at least 1 iteration, got {window}")
    load = store.expert_load(run_id, phase, layers, iterations)
    if load.empty:
        raise StoreError(
            "no router.expert_counts captured for these iterations and layers (capture --dmi-hooks router)"
        )
    load = load.rename(columns={"tokens_pre": "tokens"})[["iteration", "layer", "expert", "tokens"]]

    frequency = load.groupby(["layer", "expert"], as_index=False)["tokens"].sum()
    frequency["share"] = _share(frequency, ["layer"])

    its = sorted(load["iteration"].unique())
    position = {it: i // window for i, it in enumerate(its)}  # windows of captured iterations
    load["window"] = load["iteration"].map(position)
    bounds = load.groupby("window")["iteration"].agg(window_start="min", window_end="max")
    heatmap = load.groupby(["window", "layer", "expert"], as_index=False)["tokens"].sum()
    heatmap = heatmap.join(bounds, on="window").drop(columns="window")
    heatmap["share"] = _share(heatmap, ["window_start", "layer"])
    heatmap = heatmap[["window_start", "window_end", "layer", "expert", "tokens", "share"]]

    rows = []
    for layer, d in frequency.groupby("layer"):
        cumulative = np.cumsum(np.sort(d["share"].to_numpy())[::-1])
        rows += [{"layer": layer, "top_n": n + 1, "coverage": float(c)} for n, c in enumerate(cumulative)]
    return RoutingConcentration(
        frequency.reset_index(drop=True),
        heatmap.reset_index(drop=True),
        pd.DataFrame(rows, columns=["layer", "top_n", "coverage"]),
    )


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (ties take their average rank); NaN when either side is constant."""
    ra = pd.Series(a).rank().to_numpy()
    rb = pd.Series(b).rank().to_numpy()
    return _pearson(ra, rb)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    denominator = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / denominator) if denominator > 0 else float("nan")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors (NaN if either is zero)."""
    denominator = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / denominator) if denominator > 0 else float("nan")


def predicted_expert_counts(hidden: np.ndarray, weight: np.ndarray, topk: int) -> np.ndarray:
    """Tokens per expert among the top-``topk`` of ``hidden @ weight.T`` (hidden: [..., h], weight
    [E, h]), computed in fp32; ties go to the lower expert id."""
    logits = hidden.reshape(-1, hidden.shape[-1]).astype(np.float32) @ weight.astype(np.float32).T
    order = descending_order(logits)[:, :topk]
    return np.bincount(order.reshape(-1), minlength=weight.shape[0])


def _stored(
    store: Store, run_id: str, phase: str, iteration: int, attempt: int, output: str, columns: str, layer: int = -1
) -> list[tuple]:
    """Distinct ``columns`` of the original-forward records of ``output`` in one iteration (one layer
    unless ``layer`` is -1)."""
    table = store.sql(
        f"SELECT DISTINCT {columns} FROM {store.t('tensors')} FINAL WHERE run_id = {{run:String}}"
        f" AND phase = {{phase:String}} AND output = {{output:String}} AND iteration = {{it:Int64}}"
        f" AND attempt = {{att:Int32}} AND invocation = 0 AND ({{layer:Int32}} = -1 OR layer = {{layer:Int32}})"
        f" ORDER BY {columns}",
        {
            "run": run_id,
            "phase": phase,
            "output": output,
            "it": int(iteration),
            "att": int(attempt),
            "layer": int(layer),
        },
    )
    return list(zip(*(table.column(c.strip()).to_pylist() for c in columns.split(","))))


def routing_predictability(
    store: Store,
    run_id: str | None = None,
    phase: str = "train",
    layers: Sequence[int] | None = None,
    iterations: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Per (iteration, layer L): layer L's router weight applied to layer L-1's ``resid.in`` of every
    stored microbatch and data-parallel rank, its top-k per token counted per expert
    (``predicted``), against the router's own choices at layer L over the same tokens
    (``actual``, from ``router.expert_counts`` before dropping): ``cosine`` and ``spearman`` of
    the two per-expert vectors, and ``tokens``. k is the router's: its choices per token.

    The router itself sees layer L's input after attention and the pre-MLP norm; this asks how much
    of that decision is already visible one layer earlier (as RouterTracer's predictability does).
    """
    run_id = store.resolve_run(run_id)
    visible = store.visible_attempts(run_id)
    its = sorted(i for p, i in visible if p == phase and (not iterations or i in set(iterations)))
    actual_all = store.expert_load(run_id, phase, None, its)
    rows = []
    for it in its:
        attempt = visible[(phase, it)]
        for (layer,) in _stored(store, run_id, phase, it, attempt, "router.weight", "layer"):
            if layer == 0 or (layers and layer not in set(layers)):
                continue
            shards = _stored(store, run_id, phase, it, attempt, "resid.in", "dp, microbatch", layer - 1)
            actual = actual_all[(actual_all.iteration == it) & (actual_all.layer == layer)]
            if not shards or actual.empty:
                continue
            weight = store.array(run_id, "router.weight", it, 0, layer, phase)
            hidden = [store.array(run_id, "resid.in", it, mb, layer - 1, phase, dp) for dp, mb in shards]
            tokens = sum(h.shape[0] * h.shape[1] for h in hidden)
            actual_counts = actual.sort_values("expert")["tokens_pre"].to_numpy(dtype=np.float64)
            topk, rest = divmod(int(actual_counts.sum()), tokens)
            if rest or topk < 1:
                raise StoreError(
                    f"iteration {it} layer {layer}: {int(actual_counts.sum())} routed slots over {tokens} "
                    "resid.in tokens is not a whole top-k: the layer's inputs or counts are incomplete"
                )
            predicted = sum(predicted_expert_counts(h, weight, topk) for h in hidden).astype(np.float64)
            rows.append(
                {
                    "iteration": it,
                    "layer": layer,
                    "topk": topk,
                    "tokens": tokens,
                    "cosine": cosine(predicted, actual_counts),
                    "spearman": spearman(predicted, actual_counts),
                    "predicted": predicted.astype(np.int64).tolist(),
                    "actual": actual_counts.astype(np.int64).tolist(),
                }
            )
    if not rows:
        raise StoreError(
            "nothing to predict: needs router.weight and router.expert_counts of a layer L >= 1 and "
            "resid.in of layer L-1 in the same iteration (capture --dmi-hooks router,resid)"
        )
    return pd.DataFrame(
        rows, columns=["iteration", "layer", "topk", "tokens", "cosine", "spearman", "predicted", "actual"]
    )


def loss_vs_routing(
    store: Store,
    run_id: str | None = None,
    phase: str = "train",
    layers: Sequence[int] | None = None,
    iterations: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Per (iteration, layer): ``tokens_dropped`` / ``tokens_kept`` (tokens the loss mask counts, by
    whether the layer dropped at least one of their routes) and their mean loss ``loss_dropped`` /
    ``loss_kept`` (NaN without such tokens), over every stored microbatch and data-parallel rank.
    A loss mask stored as NaN (the step passed none) counts every token."""
    run_id = store.resolve_run(run_id)
    visible = store.visible_attempts(run_id)
    its = sorted(i for p, i in visible if p == phase and (not iterations or i in set(iterations)))
    experts = store.expert_load(run_id, phase, layers, its).groupby("layer")["expert"].max() + 1
    sums: dict[tuple[int, int], np.ndarray] = {}  # (iteration, layer) -> [weight, loss x weight] x (dropped, kept)
    for it in its:
        attempt = visible[(phase, it)]
        routed = [
            layer
            for (layer,) in _stored(store, run_id, phase, it, attempt, "router.topk_ids", "layer")
            if (not layers or layer in set(layers)) and layer in experts.index
        ]
        for dp, mb in _stored(store, run_id, phase, it, attempt, "loss.token", "dp, microbatch"):
            loss_and_mask = store.array(run_id, "loss.token", it, mb, None, phase, dp).astype(np.float64)
            loss = loss_and_mask[..., 0].reshape(-1)
            weight = np.nan_to_num(loss_and_mask[..., 1].reshape(-1), nan=1.0)
            for layer in routed:
                ids = store.array(run_id, "router.topk_ids", it, mb, layer, phase, dp)
                if ids.shape[0] != loss.shape[0]:
                    raise StoreError(
                        f"iteration {it} microbatch {mb} dp {dp} layer {layer}: {ids.shape[0]} routed tokens "
                        f"but {loss.shape[0]} per-token losses"
                    )
                dropped = (ids == int(experts[layer])).any(axis=-1)
                acc = sums.setdefault((it, layer), np.zeros(4))
                for column, chosen in ((0, dropped), (2, ~dropped)):
                    w = weight[chosen]
                    acc[column] += float(w.sum())
                    acc[column + 1] += float((loss[chosen] * w).sum())
    if not sums:
        raise StoreError(
            "nothing to compare: needs loss.token and router.topk_ids of the same iterations "
            "(capture --dmi-hooks router,loss)"
        )
    rows = []
    for (it, layer), (w_dropped, l_dropped, w_kept, l_kept) in sorted(sums.items()):
        rows.append(
            {
                "iteration": it,
                "layer": layer,
                "tokens_dropped": w_dropped,
                "tokens_kept": w_kept,
                "loss_dropped": l_dropped / w_dropped if w_dropped else float("nan"),
                "loss_kept": l_kept / w_kept if w_kept else float("nan"),
            }
        )
    return pd.DataFrame(rows)


GRADIENTS = ("grad.resid_in", "grad.attn_context", "grad.router_logits")


@dataclass
class GradNorms:
    """``layers``: iteration, layer, output, tokens, norm (L2 norm of the output's gradient over the
    iteration's tokens: every stored microbatch and data-parallel rank), rms_per_token (norm /
    sqrt(tokens): the root mean square of the per-token gradient norms);
    ``experts``: iteration, layer, expert, norm (L2 norm of expert e's column of
    ``grad.router_logits`` over the same tokens), share (norm^2 over the layer's sum of norm^2)."""

    layers: pd.DataFrame
    experts: pd.DataFrame


def grad_norms(
    store: Store,
    run_id: str | None = None,
    phase: str = "train",
    layers: Sequence[int] | None = None,
    iterations: Sequence[int] | None = None,
) -> GradNorms:
    """Gradient norms per (iteration, layer, output) and per (iteration, layer, expert), accumulated
    in fp64 from the rebuilt tensors. The gradients are those autograd computed: of the loss the
    schedule backpropagates (divided by the number of microbatches, times the loss scale under
    fp16), so compare layers and experts within a run, and iterations at a constant loss scale."""
    run_id = store.resolve_run(run_id)
    visible = store.visible_attempts(run_id)
    its = sorted(i for p, i in visible if p == phase and (not iterations or i in set(iterations)))
    wanted_layers = set(layers or ())
    squares: dict[tuple[int, int, str], list] = {}  # (iteration, layer, output) -> [sum of squares, tokens]
    expert_squares: dict[tuple[int, int], np.ndarray] = {}  # (iteration, layer) -> [E] sums of squares
    for it in its:
        attempt = visible[(phase, it)]
        for output in GRADIENTS:
            for layer, dp, mb in _stored(store, run_id, phase, it, attempt, output, "layer, dp, microbatch"):
                if wanted_layers and layer not in wanted_layers:
                    continue
                gradient = store.array(run_id, output, it, mb, layer, phase, dp).astype(np.float64)
                acc = squares.setdefault((it, layer, output), [0.0, 0])
                acc[0] += float(np.square(gradient).sum())
                acc[1] += gradient.size // gradient.shape[-1]  # every dim but the last is tokens
                if output == "grad.router_logits":
                    columns = np.square(gradient).sum(axis=0)
                    expert_squares[(it, layer)] = expert_squares.get((it, layer), 0) + columns
    if not squares:
        raise StoreError(
            "no gradients captured for these iterations and layers (capture --dmi-hooks grad, or some of "
            + ", ".join(GRADIENTS)
            + ")"
        )
    layer_rows = [
        {
            "iteration": it,
            "layer": layer,
            "output": output,
            "tokens": tokens,
            "norm": float(np.sqrt(total)),
            "rms_per_token": float(np.sqrt(total / tokens)) if tokens else float("nan"),
        }
        for (it, layer, output), (total, tokens) in sorted(squares.items())
    ]
    expert_rows = []
    for (it, layer), columns in sorted(expert_squares.items()):
        total = float(columns.sum())
        for expert, value in enumerate(columns.tolist()):
            expert_rows.append(
                {
                    "iteration": it,
                    "layer": layer,
                    "expert": expert,
                    "norm": float(np.sqrt(value)),
                    "share": value / total if total > 0 else float("nan"),
                }
            )
    return GradNorms(
        pd.DataFrame(layer_rows, columns=["iteration", "layer", "output", "tokens", "norm", "rms_per_token"]),
        pd.DataFrame(expert_rows, columns=["iteration", "layer", "expert", "norm", "share"]),
    )
