"""The reading commands of ``megatron-dmi``: ``show``, ``runs``, ``describe``, ``tensor``,
``expert-load``, ``drops``, ``load``, ``export`` and the analyses. Each opens a snapshot of the
store (reader/snapshot.py: hard links under the store's ``.readers/``, removed on exit) and changes
nothing in the store, except ``load``, which writes. Only ``tensor --save`` imports torch.
"""

from __future__ import annotations

import sys

from megatron.core.dmi.cli.common import (
    add_subcommand,
    database_arg,
    fmt_bytes,
    open_store_of,
    print_table,
    run_arg,
    store_arg,
)
from megatron.core.dmi.validators import argparse_type, positive_int


# -- commands ---------------------------------------------------------------------------------
def cmd_runs(args) -> int:
    """``runs``: list the runs of a store."""
    with open_store_of(args) as store:
        runs = store.runs()
        if runs.empty:
            print("no runs")
            return 0
        runs = runs.assign(size=[fmt_bytes(int(b)) for b in runs["bytes"]]).drop(columns=["bytes"])
        print_table(runs)
    return 0


def _expert_load_table(store, run_id, iteration, layers=None):
    load = store.expert_load(run_id, iterations=[iteration], layers=layers)
    if load.empty:
        return None
    post = load.pivot(index="layer", columns="expert", values="tokens_post")
    pre = load.groupby("layer")["tokens_pre"].sum()
    tot = post.sum(axis=1)
    out = post.copy()
    out.columns = [f"e{c}" for c in out.columns]
    out["dropped"] = ((pre - tot) / pre.where(pre > 0)).fillna(0).map(lambda x: f"{x:.1%}")
    out["max/mean"] = (
        (post.max(axis=1) / post.mean(axis=1).where(post.mean(axis=1) > 0)).fillna(0).map(lambda x: f"{x:.2f}")
    )
    return out.reset_index()


def _load_iteration_note(parts: dict[int, int], it: int, chosen: bool) -> str:
    """Why ``show``'s expert-load table describes iteration ``it``: complete (every ``router.expert_counts``
    part in) or partial, and which newer iterations were passed over as partial."""
    full = max(parts.values()) if parts else 0
    newer = [(i, n) for i, n in parts.items() if i > it and n < full]
    if parts.get(it, 0) < full:
        return (
            f"(iteration {it} is partial: {parts.get(it, 0)} of {full} router.expert_counts parts (microbatch x layer "
            f"x data-parallel rank x token range), so its load and imbalance cover only what was captured)"
        )
    why = "the latest complete iteration" if chosen else "complete"
    if newer:
        skipped = ", ".join(f"{i} ({n} of {full} parts)" for i, n in newer[-3:])
        return f"(iteration {it}: {why}; newer and partial, not shown: {skipped})"
    return f"(iteration {it}: {why}, all {full} router.expert_counts parts in)"


def cmd_show(args) -> int:
    """``show``: describe the latest run (or one, or all) with its records per output."""
    with open_store_of(args) as store:
        runs = store.runs()
        if runs.empty:
            print(f"no runs in {args.store}")
            return 0
        run_ids = list(runs["run_id"]) if args.all_runs else [store.resolve_run(args.run_id)]
        if not args.all_runs and len(runs) > 1:
            print(f"(latest of {len(runs)} runs; --all shows every run, `runs` lists them)")
        for run_id in run_ids:
            d = store.describe(run_id)
            print(d)
            print("records per output:")
            print_table(
                d.outputs.assign(size=[fmt_bytes(int(b)) for b in d.outputs["bytes"]])[
                    [
                        "phase",
                        "output",
                        "records",
                        "size",
                        "n_iterations",
                        "first_iteration",
                        "last_iteration",
                        "layers",
                    ]
                ]
            )
            parts = store.expert_count_parts(run_id) if d.iterations.get("train") else {}
            it = args.iteration if args.iteration is not None else store.latest_complete_iteration(run_id)
            if it is not None:
                t = _expert_load_table(store, run_id, it)
                if t is not None:
                    print(_load_iteration_note(parts, it, chosen=args.iteration is None))
                    print(f"expert load (tokens after capacity dropping) at iteration {it}:")
                    print_table(t)
                else:
                    print(f"no router.expert_counts at iteration {it}")
            print()
    return 0


def cmd_describe(args) -> int:
    """``describe``: one run's outputs, and with ``--config`` its capture configuration."""
    with open_store_of(args) as store:
        d = store.describe(args.run_id)
        print(d)
        print_table(d.outputs)
        if args.config:
            import json

            print(
                json.dumps(
                    {
                        "dmi_config": d.config,
                        "model": d.model,
                        "layout": d.layout,
                        "command_line": d.command_line,
                        "versions": d.versions,
                    },
                    indent=2,
                    sort_keys=True,
                )
            )
    return 0


def cmd_tensor(args) -> int:
    """``tensor``: rebuild one full tensor from its shards and print or save it (torch only for ``--save``)."""
    import numpy as np

    from megatron.core.dmi.reader import AmbiguousLayerError

    with open_store_of(args) as store:
        run_id = store.resolve_run(args.run_id)
        try:
            t = store.rebuild(
                run_id, args.output, args.iteration, args.microbatch, args.layer, args.phase, args.dp, args.invocation
            )
        except AmbiguousLayerError as e:
            print(f"error: {e.message('--layer')}", file=sys.stderr)
            return 2
    print(
        f"{args.output} run {run_id} iteration {args.iteration} microbatch {args.microbatch} layer {args.layer}: "
        f"shape {list(t.shape)} dtype {t.dtype}"
    )
    if t.values.size:
        f = t.values.astype(np.float64)
        with np.errstate(all="ignore"):  # inf - inf in the mean is the NaN printed, not a warning
            print(
                f"  min {f.min():.6g}  max {f.max():.6g}  mean {f.mean():.6g}  std {f.std(ddof=1) if f.size > 1 else 0.0:.6g}"
                f"  nan {int(np.isnan(f).sum())}  inf {int(np.isinf(f).sum())}"
            )
    if args.save:
        import torch

        torch.save(t.torch(), args.save)
        print(f"  saved to {args.save}")
    return 0


def _no_expert_counts(store, run_id: str, layers: list[int] | None, iteration: int | None) -> int:
    """Say why ``expert-load`` found nothing: no counts captured at all, or none at the layers or iteration asked
    for (naming the captured ones); returns 0 when nothing was captured, 2 when the request missed."""
    from megatron.core.dmi.reader.errors import format_ranges

    load = store.expert_load(run_id)
    if load.empty:
        print(f"run {run_id} captured no router.expert_counts (capture them with --dmi-hooks router)")
        return 0
    asked = ", ".join(
        ([f"layer(s) {format_ranges(layers)}"] if layers else [])
        + ([f"iteration {iteration}"] if iteration is not None else [])
    )
    print(
        f"error: no router.expert_counts at {asked} in run {run_id}: captured at layer(s) "
        f"{format_ranges(load['layer'].unique().tolist())}, iteration(s) {format_ranges(load['iteration'].unique().tolist())}",
        file=sys.stderr,
    )
    return 2


def cmd_expert_load(args) -> int:
    """``expert-load``: tokens per expert after capacity dropping, per layer."""
    with open_store_of(args) as store:
        run_id = store.resolve_run(args.run_id)
        if args.iteration is not None:
            t = _expert_load_table(store, run_id, args.iteration, args.layer)
            if t is None:
                return _no_expert_counts(store, run_id, args.layer, args.iteration)
            print(f"expert load at iteration {args.iteration} (tokens after dropping):")
            print_table(t)
            return 0
        load = store.expert_load(run_id, layers=args.layer)
        if load.empty:
            return _no_expert_counts(store, run_id, args.layer, None)
        g = load.groupby(["iteration", "layer"])
        s = g["tokens_post"].agg(["sum", "max", "mean"]).reset_index()
        pre = g["tokens_pre"].sum().values
        s["dropped"] = [f"{(p - q) / p:.1%}" if p else "0.0%" for p, q in zip(pre, s["sum"])]
        s["max/mean"] = (s["max"] / s["mean"].where(s["mean"] > 0)).fillna(0).round(2)
        print_table(s.rename(columns={"sum": "tokens"}).drop(columns=["mean"]))
    return 0


def cmd_drops(args) -> int:
    """``drops``: the records a run dropped before they were persisted."""
    with open_store_of(args) as store:
        run_id = store.resolve_run(args.run_id)
        drops = store.dropped_records(run_id)
        print(f"records dropped before persistence in run {run_id}: {len(drops)}")
        if not drops.empty:
            print_table(drops.groupby(["reason", "output"]).size().reset_index(name="records"))
        rate = store.drop_rate(run_id)
        if not rate.empty:
            print("tokens dropped by the capacity factor:")
            partial = ~rate["complete"]
            shown = rate.drop(columns=["complete"]).assign(
                drop_rate=[f"{x:.1%}" if ok else f"{x:.1%} *" for x, ok in zip(rate["drop_rate"], rate["complete"])]
            )
            print_table(shown)
            if partial.any():
                print(
                    f"* partial: {int(partial.sum())} iteration(s) lost router.expert_counts records before "
                    f"persistence (see above), so their rate covers only the tokens that arrived"
                )
        reps = store.reports(run_id)
        if not reps.empty:
            print("sink reports:")
            print_table(reps[["attempt", "rank", "sink", "records_written", "records_spooled", "records_dropped"]])
    return 0


def cmd_load(args) -> int:
    """``load``: load a spool directory's segments into a store; returns 1 if any failed."""
    import os

    from megatron.core.dmi.reader import StoreBusyError, open_store, resolve_store_dir
    from megatron.core.dmi.store.ingester import live_ingester

    src = args.source
    if os.path.isdir(os.path.join(src, "spool")):
        src = os.path.join(src, "spool")
    if not os.path.isdir(src):
        print(f"error: no spool directory at {args.source}", file=sys.stderr)
        return 2
    target = args.store_target
    if "://" not in target:
        os.makedirs(target, exist_ok=True)
    try:
        store = open_store(target, database=args.database, writable=True)
    except StoreBusyError:
        store_dir = resolve_store_dir(target)[0]
        holder = live_ingester(store_dir)
        if holder is None:  # a `load` or another writable session: the lock's own message says who
            raise
        return _load_beside_ingester(src, target, store_dir, holder)
    with store:
        r = store.load(src, delete=args.delete, progress=sys.stderr.isatty(), threads=args.threads)
    print(
        f"loaded {r.segments_loaded} segment(s): {r.records} record(s), {fmt_bytes(r.payload_bytes)} of payload; "
        f"{r.segments_skipped} already present, {r.segments_corrupt} corrupt, {r.segments_partial} partly "
        f"quarantined ({r.records_quarantined} record(s) in dmi.quarantine), {r.segments_unverified} not verified, "
        f"{len(r.missing_segments)} missing"
    )
    for e in r.errors:
        print(f"  ! {e}")
    _report_unfinished(src, args.delete)
    return 1 if r.errors else 0


def _load_beside_ingester(spool_root: str, target: str, store_dir: str, holder) -> int:
    """``load`` into the store ``target`` (folder ``store_dir``) that its ingester ``holder`` (an
    ``IngesterStatus``) holds: one line saying who loads what; exit 0 for the store's own spool (the ingester
    loads it), 1 for any other."""
    import os

    if os.path.realpath(spool_root) == os.path.realpath(os.path.join(store_dir, "spool")):
        print(f"nothing to do: the store's ingester (pid {holder.pid}) is loading {spool_root} into {target}")
        return 0
    print(
        f"error: the store {target} is being ingested by pid {holder.pid}; run `megatron-dmi load` into it after "
        "that process ends",
        file=sys.stderr,
    )
    return 1


def _report_unfinished(spool_root: str, delete: bool) -> None:
    """Name the unfinished segment files ``load`` skipped: a killed writer's (deleted with ``--delete``) or a live
    one's."""
    import os

    from megatron.core.dmi.store.segments import unfinished_segments

    for path, alive in unfinished_segments(spool_root):
        if alive:
            print(f"  skipped {path}: a segment its process (still running) is writing")
        elif delete:
            os.unlink(path)
            print(f"  deleted {path}: a segment its process was killed while writing (nothing in it was complete)")
        else:
            print(
                f"  skipped {path}: a segment its process was killed while writing (nothing in it was complete; "
                "--delete removes it)"
            )


def cmd_export(args) -> int:
    """``export``: write a run of a store as spool segments (loadable into another store)."""
    with open_store_of(args) as store:
        from megatron.core.dmi.cli.export import export_spool

        n = export_spool(store, args.to, args.run_id, progress=sys.stderr.isatty())
    print(
        f"exported {n} record(s) as spool segments under {args.to}; load them with "
        f"`megatron-dmi load {args.to} --store <dir-or-url>`"
    )
    return 0


def _setup_export(p):
    store_arg(p)
    p.add_argument("--run", dest="run_id", default=None, help="only this run (default: every run)")
    p.add_argument("--to", required=True, help="output spool directory (rank-* folders)")
    p.set_defaults(func=cmd_export)


def _setup_runs(p):
    store_arg(p)
    p.set_defaults(func=cmd_runs)


def _setup_show(p):
    store_arg(p)
    run_arg(p)
    p.add_argument("--all", dest="all_runs", action="store_true", help="every run in the store, oldest first")
    p.add_argument("--iteration", type=int, default=None, help="iteration for the expert load (default: the last one)")
    p.set_defaults(func=cmd_show)


def _setup_describe(p):
    store_arg(p)
    run_arg(p)
    p.add_argument(
        "--config",
        action="store_true",
        help="also print the run's DMI config, model configuration, parallel layout, command line and versions as JSON",
    )
    p.set_defaults(func=cmd_describe)


def _setup_tensor(p):
    store_arg(p)
    run_arg(p)
    p.add_argument("--output", required=True, help="hook output, e.g. router.logits")
    p.add_argument("--iteration", type=int, required=True)
    p.add_argument("--layer", type=int, default=None, help="global layer (required when several were captured)")
    p.add_argument("--microbatch", type=int, default=0)
    p.add_argument("--phase", default="train", choices=["train", "valid"])
    p.add_argument("--dp", type=int, default=0, help="data-parallel rank whose tokens to rebuild")
    p.add_argument("--invocation", type=int, default=0, help="1 = activation-recompute replay")
    p.add_argument("--save", default=None, help="write the tensor to this .pt file")
    p.set_defaults(func=cmd_tensor)


def _setup_expert_load(p):
    store_arg(p)
    run_arg(p)
    p.add_argument("--iteration", type=int, default=None, help="one iteration as a layers x experts table")
    p.add_argument("--layer", type=int, action="append", default=None, help="restrict to these layers")
    p.set_defaults(func=cmd_expert_load)


def _setup_drops(p):
    store_arg(p)
    run_arg(p)
    p.set_defaults(func=cmd_drops)


def _setup_load(p):
    p.add_argument("source", help="spool directory (holding rank-* folders) or a store directory with spool/")
    p.add_argument("--store", dest="store_target", required=True, help="target store directory or ClickHouse URL")
    p.add_argument("--database", type=database_arg, default="dmi")
    p.add_argument("--delete", action="store_true", help="delete segments once loaded")
    p.add_argument(
        "--threads",
        type=argparse_type(positive_int),
        default=None,
        help="the embedded store's chDB threads, or parallel inserts into a server (default: a quarter of the "
        "cores, 1-4, as the ingester's)",
    )
    p.set_defaults(func=cmd_load)


add_subcommand("show", _setup_show, "summary of the latest run (or --run, --all): records per output, expert load")
add_subcommand("runs", _setup_runs, "list runs")
add_subcommand("describe", _setup_describe, "what one run captured")
add_subcommand("tensor", _setup_tensor, "rebuild one full tensor: shape, dtype, stats, optional .pt")
add_subcommand("expert-load", _setup_expert_load, "tokens per expert per layer over iterations")
add_subcommand("drops", _setup_drops, "dropped records and dropped-token rates")
add_subcommand("load", _setup_load, "load spool segments into a store")
add_subcommand("export", _setup_export, "write a store back out as spool segments (to merge node-local stores)")


# -- routing analyses (reader/analyses.py) -----------------------------------------------------
def cmd_routing_concentration(args) -> int:
    """``routing-concentration``: each layer's share of routed tokens per expert."""
    from megatron.core.dmi.reader.analyses import routing_concentration

    with open_store_of(args) as store:
        result = routing_concentration(store, args.run_id, args.phase, args.layer, None, args.window)
    share = result.frequency.pivot(index="layer", columns="expert", values="share")
    print("expert frequency (share of each layer's routed slots, before capacity dropping):")
    print_table((share * 100).round(1).reset_index())
    coverage = result.coverage.pivot(index="layer", columns="top_n", values="coverage")
    print("\ntop-N coverage (share of routed slots taken by the N most chosen experts):")
    print_table((coverage * 100).round(1).reset_index())
    hot = result.heatmap.loc[result.heatmap.groupby(["window_start", "layer"])["share"].idxmax()]
    print(f"\nhottest expert per layer, windows of {args.window} captured iteration(s):")
    print_table(hot.assign(share=(hot["share"] * 100).round(1)))
    return 0


def cmd_routing_predictability(args) -> int:
    """``routing-predictability``: layer L's router applied to layer L-1's input."""
    from megatron.core.dmi.reader.analyses import routing_predictability

    with open_store_of(args) as store:
        table = routing_predictability(store, args.run_id, args.phase, args.layer, args.iteration)
    print("layer L's router on layer L-1's resid.in: predicted vs actual tokens per expert (before dropping)")
    print_table(table[["iteration", "layer", "tokens", "cosine", "spearman"]].round(4))
    print("\nper layer (mean over iterations):")
    print_table(table.groupby("layer", as_index=False)[["cosine", "spearman"]].mean().round(4))
    return 0


def cmd_loss_vs_routing(args) -> int:
    """``loss-vs-routing``: per-token loss of tokens with a dropped route vs the rest."""
    from megatron.core.dmi.reader.analyses import loss_vs_routing

    with open_store_of(args) as store:
        table = loss_vs_routing(store, args.run_id, args.phase, args.layer)
    print("mean per-token loss of tokens with a route dropped by the capacity factor vs tokens that kept all:")
    print_table(table.round(4))
    return 0


def cmd_grad_norms(args) -> int:
    """``grad-norms``: gradient norms per layer and output."""
    from megatron.core.dmi.reader.analyses import grad_norms

    with open_store_of(args) as store:
        result = grad_norms(store, args.run_id, args.phase, args.layer, args.iteration)
    per_layer = result.layers.pivot_table(index=["iteration", "layer"], columns="output", values="rms_per_token")
    print("gradient RMS per token (L2 norm over the iteration's tokens / sqrt(tokens)), per layer:")
    print_table(per_layer.reset_index())
    print("\nper layer (mean over iterations):")
    print_table(per_layer.groupby("layer").mean().reset_index())
    if not result.experts.empty:
        share = result.experts.pivot_table(index=["iteration", "layer"], columns="expert", values="share")
        share.columns = [f"e{c}" for c in share.columns]
        print("\nrouter-logit gradient per expert: share of the layer's squared norm (%):")
        print_table((share * 100).round(1).reset_index())
    return 0


def _analysis_args(p, layer_help: str) -> None:
    store_arg(p)
    run_arg(p)
    p.add_argument("--phase", default="train", choices=["train", "valid"])
    p.add_argument("--layer", type=int, action="append", default=None, help=layer_help)


def _setup_routing_concentration(p):
    _analysis_args(p, "restrict to these layers")
    p.add_argument("--window", type=int, default=1, help="captured iterations per heatmap window (default: 1)")
    p.set_defaults(func=cmd_routing_concentration)


def _setup_routing_predictability(p):
    _analysis_args(p, "restrict to these layers L (>= 1)")
    p.add_argument("--iteration", type=int, action="append", default=None, help="restrict to these iterations")
    p.set_defaults(func=cmd_routing_predictability)


def _setup_loss_vs_routing(p):
    _analysis_args(p, "restrict to these layers")
    p.set_defaults(func=cmd_loss_vs_routing)


def _setup_grad_norms(p):
    _analysis_args(p, "restrict to these layers")
    p.add_argument("--iteration", type=int, action="append", default=None, help="restrict to these iterations")
    p.set_defaults(func=cmd_grad_norms)


add_subcommand(
    "routing-concentration",
    _setup_routing_concentration,
    "expert frequency, hot experts per iteration window and top-N coverage, per layer",
)
add_subcommand(
    "routing-predictability",
    _setup_routing_predictability,
    "layer L's router applied to layer L-1's resid.in: cosine and Spearman vs the actual routing",
)
add_subcommand(
    "loss-vs-routing",
    _setup_loss_vs_routing,
    "per-token loss of tokens whose routes were dropped vs kept, per layer and iteration",
)


add_subcommand(
    "grad-norms",
    _setup_grad_norms,
    "gradient norms (needs --dmi-hooks grad) per layer and per expert over iterations",
)


def cmd_routing_diff(args) -> int:
    """Print the routing difference of two runs, per layer and iteration."""
    from megatron.core.dmi.reader.routing_diff import ExpertSetsProcess, read_expert_sets, routing_diff

    with ExpertSetsProcess(args.run_b, args.phase) as other:  # reads run B while this process reads run A
        run_a, sets_a = read_expert_sets(args.run_a, args.phase)
        run_b, sets_b = other.result()
    df = routing_diff(sets_a, sets_b)
    print(f"routing difference of run {run_a} and run {run_b} ({args.phase}): share of tokens whose expert set differs")
    print_table(df)
    print(
        f"overall: {df['differing'].sum()} of {df['tokens'].sum()} tokens ({df['differing'].sum() / df['tokens'].sum():.2%})"
    )
    return 0


def _setup_routing_diff(p) -> None:
    p.add_argument(
        "run_a", metavar="STORE_A[@RUN]", help="a store directory or URL, and a run id (default: its latest)"
    )
    p.add_argument("run_b", metavar="STORE_B[@RUN]", help="the other run, in the same store or another")
    p.add_argument("--phase", default="train", help="phase compared (default: train)")
    p.set_defaults(func=cmd_routing_diff)


add_subcommand(
    "routing-diff",
    _setup_routing_diff,
    "per layer and iteration, the share of tokens whose expert set differs between two runs (needs router.topk_ids)",
)
