"""``megatron-dmi <command>`` (or ``python -m megatron.core.dmi <command>``): look at what a run
captured, during the run or after it.

Reading commands open a snapshot of the store (see reader/snapshot.py) and change nothing on disk;
only ``load`` writes. This module and the reader import pyarrow, pandas and chDB, not torch
(only ``tensor`` does) nor megatron-core, so ``megatron-dmi`` starts fast (benchmarks/cli_speed.py;
megatron_dmi/__init__.py says why ``python -m megatron.core.dmi`` cannot).

Commands register through ``add_subcommand(name, setup, help)``; ``setup(parser)`` adds the
command's arguments and sets ``func`` (a callable taking the parsed args, returning an exit code).
Other modules can add commands (e.g. ``doctor``) by calling ``add_subcommand`` before ``main``,
or by being listed in ``EXTRA_COMMAND_MODULES`` (imported lazily; each calls ``add_subcommand``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable

SetupFn = Callable[[argparse.ArgumentParser], None]
_COMMANDS: dict[str, tuple[SetupFn, str]] = {}
# Modules that register more subcommands when imported (missing ones are skipped).
EXTRA_COMMAND_MODULES = [
    "megatron.core.dmi.doctor",
    "megatron.core.dmi.reader.watch",
    "megatron.core.dmi.reader.routing_diff",
]


def add_subcommand(name: str, setup: SetupFn, help: str) -> None:
    """Register a subcommand: ``setup`` adds its arguments to its parser."""
    _COMMANDS[name] = (setup, help)


def database_arg(value: str) -> str:
    """The argparse type of every database flag (here and --dmi-clickhouse-database)."""
    from megatron.core.dmi.sinks.schema import IdentifierError, check_database

    try:
        return check_database(value)
    except IdentifierError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store directory (--dmi-store-dir) or ClickHouse URL http(s)://host:port")
    p.add_argument("--database", type=database_arg, default="dmi", help="database name (default: dmi)")


def _run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", dest="run_id", default=None, help="run id (default: the latest run)")


def open_for_reading(store: str, database: str, quiet: bool = False):
    """A read-only snapshot view of ``store`` (a URL: the server itself); says what it took from
    the spool (segments the store has not loaded yet: a live run's latest, a crash's leftovers)."""
    from megatron.core.dmi.reader import open_store

    opened = open_store(store, database=database, progress=sys.stderr.isatty() and not quiet)
    r = opened.ingest_result
    if (r.segments_loaded or r.segments_corrupt or r.errors) and not quiet:
        print(
            f"(read {r.segments_loaded} spool segment(s) not in the store yet, {r.records} record(s)"
            + (f"; {r.segments_corrupt} corrupt segment(s) skipped" if r.segments_corrupt else "")
            + (f"; {r.records_quarantined} record(s) quarantined" if r.records_quarantined else "")
            + "; the files are left as they are)"
        )
        for e in r.errors:
            print(f"  ! {e}")
    return opened


def _open(args):
    return open_for_reading(args.store, args.database)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_table(df, max_rows: int = 200) -> None:
    import pandas as pd

    with pd.option_context("display.max_rows", max_rows, "display.max_columns", 50, "display.width", 200):
        print(df.to_string(index=False) if not df.empty else "(none)")


# -- commands ---------------------------------------------------------------------------------
def cmd_runs(args) -> int:
    """``runs``: list the runs of a store."""
    with _open(args) as store:
        runs = store.runs()
        if runs.empty:
            print("no runs")
            return 0
        runs = runs.assign(size=[_fmt_bytes(int(b)) for b in runs["bytes"]]).drop(columns=["bytes"])
        _print_table(runs)
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


def cmd_show(args) -> int:
    """``show``: describe the latest run (or one, or all) with its records per output."""
    with _open(args) as store:
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
            _print_table(
                d.outputs.assign(size=[_fmt_bytes(int(b)) for b in d.outputs["bytes"]])[
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
            its = d.iterations.get("train", [])
            load_its = sorted(store.expert_load(run_id)["iteration"].unique()) if its else []
            it = args.iteration if args.iteration is not None else (int(load_its[-1]) if load_its else None)
            if it is not None:
                t = _expert_load_table(store, run_id, it)
                if t is not None:
                    print(f"expert load (tokens after capacity dropping) at iteration {it}:")
                    _print_table(t)
                else:
                    print(f"no router.expert_counts at iteration {it}")
            print()
    return 0


def cmd_describe(args) -> int:
    """``describe``: one run's outputs, and with ``--config`` its capture configuration."""
    with _open(args) as store:
        d = store.describe(args.run_id)
        print(d)
        _print_table(d.outputs)
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
    """``tensor``: rebuild one full tensor from its shards and print or save it."""
    import torch

    from megatron.core.dmi.reader import AmbiguousLayerError

    with _open(args) as store:
        run_id = store.resolve_run(args.run_id)
        try:
            t = store.tensor(
                run_id, args.output, args.iteration, args.microbatch, args.layer, args.phase, args.dp, args.invocation
            )
        except AmbiguousLayerError as e:
            print(f"error: {e.message('--layer')}", file=sys.stderr)
            return 2
    print(
        f"{args.output} run {run_id} iteration {args.iteration} microbatch {args.microbatch} layer {args.layer}: "
        f"shape {list(t.shape)} dtype {str(t.dtype).replace('torch.', '')}"
    )
    if t.numel():
        f = t.double()
        print(
            f"  min {f.min().item():.6g}  max {f.max().item():.6g}  mean {f.mean().item():.6g}  "
            f"std {f.std().item() if t.numel() > 1 else 0.0:.6g}  nan {int(torch.isnan(f).sum())}  inf {int(torch.isinf(f).sum())}"
        )
    if args.save:
        torch.save(t, args.save)
        print(f"  saved to {args.save}")
    return 0


def cmd_expert_load(args) -> int:
    """``expert-load``: tokens per expert after capacity dropping, per layer."""
    with _open(args) as store:
        run_id = store.resolve_run(args.run_id)
        if args.iteration is not None:
            t = _expert_load_table(store, run_id, args.iteration, args.layer)
            print(f"expert load at iteration {args.iteration} (tokens after dropping):")
            _print_table(t if t is not None else __import__("pandas").DataFrame())
            return 0
        load = store.expert_load(run_id, layers=args.layer)
        if load.empty:
            print("no router.expert_counts captured")
            return 0
        g = load.groupby(["iteration", "layer"])
        s = g["tokens_post"].agg(["sum", "max", "mean"]).reset_index()
        pre = g["tokens_pre"].sum().values
        s["dropped"] = [f"{(p - q) / p:.1%}" if p else "0.0%" for p, q in zip(pre, s["sum"])]
        s["max/mean"] = (s["max"] / s["mean"].where(s["mean"] > 0)).fillna(0).round(2)
        _print_table(s.rename(columns={"sum": "tokens"}).drop(columns=["mean"]))
    return 0


def cmd_drops(args) -> int:
    """``drops``: the records a run dropped before they were persisted."""
    with _open(args) as store:
        run_id = store.resolve_run(args.run_id)
        drops = store.dropped_records(run_id)
        print(f"records dropped before persistence in run {run_id}: {len(drops)}")
        if not drops.empty:
            _print_table(drops.groupby(["reason", "output"]).size().reset_index(name="records"))
        rate = store.drop_rate(run_id)
        if not rate.empty:
            print("tokens dropped by the capacity factor:")
            partial = ~rate["complete"]
            shown = rate.drop(columns=["complete"]).assign(
                drop_rate=[f"{x:.1%}" if ok else f"{x:.1%} *" for x, ok in zip(rate["drop_rate"], rate["complete"])]
            )
            _print_table(shown)
            if partial.any():
                print(
                    f"* partial: {int(partial.sum())} iteration(s) lost router.expert_counts records before "
                    f"persistence (see above), so their rate covers only the tokens that arrived"
                )
        reps = store.reports(run_id)
        if not reps.empty:
            print("sink reports:")
            _print_table(reps[["attempt", "rank", "sink", "records_written", "records_spooled", "records_dropped"]])
    return 0


def cmd_load(args) -> int:
    """``load``: load a spool directory's segments into a store; returns 1 if any failed."""
    import os

    from megatron.core.dmi.reader import open_store

    src = args.source
    if os.path.isdir(os.path.join(src, "spool")):
        src = os.path.join(src, "spool")
    if not os.path.isdir(src):
        print(f"error: no spool directory at {args.source}", file=sys.stderr)
        return 2
    target = args.store_target
    if "://" not in target:
        os.makedirs(target, exist_ok=True)
    with open_store(target, database=args.database, writable=True) as store:
        r = store.load(src, delete=args.delete, progress=sys.stderr.isatty())
    print(
        f"loaded {r.segments_loaded} segment(s): {r.records} record(s), {_fmt_bytes(r.payload_bytes)} of payload; "
        f"{r.segments_skipped} already present, {r.segments_corrupt} corrupt, {r.segments_partial} partly "
        f"quarantined ({r.records_quarantined} record(s) in dmi.quarantine), {r.segments_unverified} not verified, "
        f"{len(r.missing_segments)} missing"
    )
    for e in r.errors:
        print(f"  ! {e}")
    return 1 if r.errors else 0


def cmd_export(args) -> int:
    """``export``: write a run of a store as spool segments (loadable into another store)."""
    with _open(args) as store:
        from megatron.core.dmi.sinks.export import export_spool

        n = export_spool(store, args.to, args.run_id, progress=sys.stderr.isatty())
    print(
        f"exported {n} record(s) as spool segments under {args.to}; load them with "
        f"`python -m megatron.core.dmi load {args.to} --store <dir-or-url>`"
    )
    return 0


def _setup_export(p):
    _store_arg(p)
    p.add_argument("--run", dest="run_id", default=None, help="only this run (default: every run)")
    p.add_argument("--to", required=True, help="output spool directory (rank-* folders)")
    p.set_defaults(func=cmd_export)


def _setup_runs(p):
    _store_arg(p)
    p.set_defaults(func=cmd_runs)


def _setup_show(p):
    _store_arg(p)
    _run_arg(p)
    p.add_argument("--all", dest="all_runs", action="store_true", help="every run in the store, oldest first")
    p.add_argument("--iteration", type=int, default=None, help="iteration for the expert load (default: the last one)")
    p.set_defaults(func=cmd_show)


def _setup_describe(p):
    _store_arg(p)
    _run_arg(p)
    p.add_argument(
        "--config",
        action="store_true",
        help="also print the run's DMI config, model configuration, parallel layout, command line and versions as JSON",
    )
    p.set_defaults(func=cmd_describe)


def _setup_tensor(p):
    _store_arg(p)
    _run_arg(p)
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
    _store_arg(p)
    _run_arg(p)
    p.add_argument("--iteration", type=int, default=None, help="one iteration as a layers x experts table")
    p.add_argument("--layer", type=int, action="append", default=None, help="restrict to these layers")
    p.set_defaults(func=cmd_expert_load)


def _setup_drops(p):
    _store_arg(p)
    _run_arg(p)
    p.set_defaults(func=cmd_drops)


def _setup_load(p):
    p.add_argument("source", help="spool directory (holding rank-* folders) or a store directory with spool/")
    p.add_argument("--store", dest="store_target", required=True, help="target store directory or ClickHouse URL")
    p.add_argument("--database", type=database_arg, default="dmi")
    p.add_argument("--delete", action="store_true", help="delete segments once loaded")
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

    with _open(args) as store:
        result = routing_concentration(store, args.run_id, args.phase, args.layer, None, args.window)
    share = result.frequency.pivot(index="layer", columns="expert", values="share")
    print("expert frequency (share of each layer's routed slots, before capacity dropping):")
    _print_table((share * 100).round(1).reset_index())
    coverage = result.coverage.pivot(index="layer", columns="top_n", values="coverage")
    print("\ntop-N coverage (share of routed slots taken by the N most chosen experts):")
    _print_table((coverage * 100).round(1).reset_index())
    hot = result.heatmap.loc[result.heatmap.groupby(["window_start", "layer"])["share"].idxmax()]
    print(f"\nhottest expert per layer, windows of {args.window} captured iteration(s):")
    _print_table(hot.assign(share=(hot["share"] * 100).round(1)))
    return 0


def cmd_routing_predictability(args) -> int:
    """``routing-predictability``: layer L's router applied to layer L-1's input."""
    from megatron.core.dmi.reader.analyses import routing_predictability

    with _open(args) as store:
        table = routing_predictability(store, args.run_id, args.phase, args.layer, args.iteration)
    print("layer L's router on layer L-1's resid.in: predicted vs actual tokens per expert (before dropping)")
    _print_table(table[["iteration", "layer", "tokens", "cosine", "spearman"]].round(4))
    print("\nper layer (mean over iterations):")
    _print_table(table.groupby("layer", as_index=False)[["cosine", "spearman"]].mean().round(4))
    return 0


def cmd_loss_vs_routing(args) -> int:
    """``loss-vs-routing``: per-token loss of tokens with a dropped route vs the rest."""
    from megatron.core.dmi.reader.analyses import loss_vs_routing

    with _open(args) as store:
        table = loss_vs_routing(store, args.run_id, args.phase, args.layer)
    print("mean per-token loss of tokens with a route dropped by the capacity factor vs tokens that kept all:")
    _print_table(table.round(4))
    return 0


def cmd_grad_norms(args) -> int:
    """``grad-norms``: gradient norms per layer and output."""
    from megatron.core.dmi.reader.analyses import grad_norms

    with _open(args) as store:
        result = grad_norms(store, args.run_id, args.phase, args.layer, args.iteration)
    per_layer = result.layers.pivot_table(index=["iteration", "layer"], columns="output", values="rms_per_token")
    print("gradient RMS per token (L2 norm over the iteration's tokens / sqrt(tokens)), per layer:")
    _print_table(per_layer.reset_index())
    print("\nper layer (mean over iterations):")
    _print_table(per_layer.groupby("layer").mean().reset_index())
    if not result.experts.empty:
        share = result.experts.pivot_table(index=["iteration", "layer"], columns="expert", values="share")
        share.columns = [f"e{c}" for c in share.columns]
        print("\nrouter-logit gradient per expert: share of the layer's squared norm (%):")
        _print_table((share * 100).round(1).reset_index())
    return 0


def _analysis_args(p, layer_help: str) -> None:
    _store_arg(p)
    _run_arg(p)
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


def build_parser(prog: str = "python -m megatron.core.dmi") -> argparse.ArgumentParser:
    """The command-line parser with every registered subcommand."""
    for mod in EXTRA_COMMAND_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            if getattr(e, "name", None) != mod:
                raise
    parser = argparse.ArgumentParser(
        prog=prog, description="Inspect Megatron-DMI captures (runs, tensors, expert load)."
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for name, (setup, help_) in _COMMANDS.items():
        setup(sub.add_parser(name, help=help_, description=help_))
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m megatron.core.dmi") -> int:
    """Run the command line ``argv``; returns the exit status (DMI's own errors print, not raise)."""
    # Upstream libraries' import-time notices (no CUDA, no Transformer Engine/apex, absl) are not
    # the user's business here; DMI's own warnings (e.g. a corrupt segment) still show.
    warnings.filterwarnings("ignore", module=r"(torch|transformer_engine|apex|megatron\.core(?!\.dmi))(\.|$)")
    args = build_parser(prog).parse_args(argv)
    from megatron.core.dmi.reader import ReconstructionError, SchemaVersionError, StoreBusyError, StoreError
    from megatron.core.dmi.sinks import BackendError, IdentifierError, ServerURLError

    try:
        return int(args.func(args) or 0)
    except (
        StoreError,
        StoreBusyError,
        SchemaVersionError,
        ReconstructionError,
        BackendError,
        IdentifierError,
        ServerURLError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
