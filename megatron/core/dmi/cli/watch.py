"""``megatron-dmi watch <store>``: a compact live view of a run, refreshed every few seconds.

Each refresh opens a fresh snapshot of the store (reader/snapshot.py: the training run keeps
ingesting) and shows, for the latest iteration whose expert counts are all in, per MoE layer: the tokens each
expert received after capacity dropping, the imbalance (max/mean), the capacity drop rate and the
router's normalised entropy (when ``router.logits`` are captured); then the run's records and bytes
and the store lag (records in closed spool segments that the store has not loaded yet; the view
already includes them), with the ingester process's own view of it (``<store>/ingester.json``: when it
last made a pass, and how long the oldest segment has waited). ``--once`` prints one frame and exits; ``--json`` prints the frame's
numbers instead of the table (for scripts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

from megatron.core.dmi.cli.common import add_subcommand, fmt_bytes, open_for_reading, run_arg, store_arg

ROUTER_LOGITS = "router.logits"
_BARS = " ▁▂▃▄▅▆▇█"
MAX_EXPERTS_AS_NUMBERS = 8  # wider layers show one bar character per expert


@dataclass
class LayerStats:
    """One MoE layer's routing in a watch frame: expert loads, imbalance, drop rate, entropy."""

    layer: int
    tokens_routed: int  # token slots routed to experts, before capacity dropping
    expert_tokens: list[int]  # per expert, after capacity dropping
    imbalance: float  # max/mean of expert_tokens (1 = perfectly balanced)
    drop_rate: float  # share of routed slots dropped by the capacity factor
    entropy: float | None = None  # mean per-token routing entropy / log(experts); None: no router.logits


@dataclass
class WatchFrame:
    """One refresh of the watch view: the latest complete iteration's layers and the run's totals."""

    store: str
    run_id: str | None
    taken_at: str
    attempt: int = 0
    first_iteration: int | None = None
    last_iteration: int | None = None
    records: int = 0  # visible tensor records of the run
    bytes: int = 0
    store_lag_records: int = 0  # in closed spool segments the store has not loaded yet
    store_lag_segments: int = 0
    dropped_records: int = 0  # lost before persistence (ring full, disk full)
    load_iteration: int | None = None  # the iteration the per-layer numbers describe
    layers: list[LayerStats] = field(default_factory=list)
    store_missing: bool = False  # no store at the path yet: the run has not created it (watch waits for it)
    ingester: str = ""  # the store's ingester process and its lag (its <store>/ingester.json), "" if none reported


def _layer_stats(load, entropy) -> list[LayerStats]:
    out = []
    for layer, g in load.groupby("layer"):
        post = [int(x) for x in g.sort_values("expert")["tokens_post"]]
        pre = int(g["tokens_pre"].sum())
        mean = sum(post) / len(post) if post else 0.0
        out.append(
            LayerStats(
                layer=int(layer),
                tokens_routed=pre,
                expert_tokens=post,
                imbalance=max(post) / mean if mean > 0 else 0.0,
                drop_rate=(pre - sum(post)) / pre if pre > 0 else 0.0,
                entropy=entropy.get(int(layer)),
            )
        )
    return out


def collect(store_path: str, database: str = "dmi", run_id: str | None = None, entropy: bool = True) -> WatchFrame:
    """One frame: a fresh snapshot of the store, read and closed."""
    from megatron.core.dmi.reader.errors import NotAStoreError

    frame = WatchFrame(store=store_path, run_id=run_id, taken_at=datetime.now().strftime("%H:%M:%S"))
    try:
        opened = open_for_reading(store_path, database, quiet=True)
    except NotAStoreError as e:
        if e.found or not (e.missing or os.path.isdir(store_path)):
            raise  # a wrong folder (stores under it) or a plain file: waiting would not help
        frame.store_missing = True
        return frame
    frame.ingester = _ingester_line(store_path)
    with opened as store:
        frame.store_lag_records = store.ingest_result.records
        frame.store_lag_segments = store.ingest_result.segments_loaded
        if store.runs().empty:
            return frame
        d = store.describe(run_id)
        frame.run_id = d.run_id
        frame.attempt = int(d.attempts["attempt"].max()) if not d.attempts.empty else 0
        its = d.iterations.get("train", [])
        frame.first_iteration, frame.last_iteration = (its[0], its[-1]) if its else (None, None)
        frame.records, frame.bytes, frame.dropped_records = d.records, d.bytes, d.dropped_records
        it = store.latest_complete_iteration(d.run_id)
        if it is None:
            return frame
        frame.load_iteration = it
        load = store.expert_load(d.run_id, iterations=[it])
        per_layer_entropy: dict[int, float] = {}
        if entropy and ROUTER_LOGITS in set(d.outputs["output"]):
            ent = store.router_entropy(d.run_id, iterations=[it])
            per_layer_entropy = {int(r.layer): float(r.entropy_normalized) for r in ent.itertuples()}
        frame.layers = _layer_stats(load, per_layer_entropy)
    return frame


def _ingester_line(store_path: str) -> str:
    """Who ingests the store and how far behind it is, from the status its ingester process publishes."""
    if "://" in store_path:
        return ""
    from megatron.core.dmi.store.ingester import read_status

    s = read_status(store_path)
    if s is None or not s.owner:
        return ""
    if s.state == "done":
        return f"ingester: ended at {datetime.fromtimestamp(s.last_pass).strftime('%H:%M:%S')}"
    now = time.time()
    lag = f", the oldest for {now - s.oldest_waiting:.0f} s" if s.oldest_waiting else ""
    return (
        f"ingester: pid {s.pid} on {s.host}, last pass {now - s.last_pass:.0f} s ago; {s.waiting_segments} spool "
        f"segment(s) ({fmt_bytes(s.waiting_bytes)}) waiting{lag}"
    )


def _bars(values: list[int]) -> str:
    top = max(values) if values else 0
    return "".join(_BARS[math.ceil(v / top * (len(_BARS) - 1))] if top else _BARS[0] for v in values)


def render(frame: WatchFrame, interval: float | None = None):
    """The frame as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        ("DMI watch ", "bold"), frame.store, f"   {frame.taken_at}", f" (every {interval:g} s)" if interval else ""
    )
    if frame.store_missing:
        return Group(head, Text("no DMI store here yet: waiting for the run to create it (its --dmi-store-dir)"))
    if frame.run_id is None:
        return Group(head, Text("no runs yet"))
    span = (
        f"iterations {frame.first_iteration}..{frame.last_iteration}"
        if frame.first_iteration is not None
        else "no iterations yet"
    )
    facts = Text.assemble(
        ("run ", "dim"),
        frame.run_id,
        ("  attempt ", "dim"),
        str(frame.attempt),
        "   ",
        span,
        ("\nrecords ", "dim"),
        f"{frame.records} ({fmt_bytes(frame.bytes)})",
        ("   dropped before persistence ", "dim"),
        (str(frame.dropped_records), "bold red" if frame.dropped_records else ""),
        ("\nstore lag ", "dim"),
        f"{frame.store_lag_records} record(s) in {frame.store_lag_segments} spool segment(s)"
        " not loaded yet (shown here already)",
        *((("\n" + frame.ingester, "dim"),) if frame.ingester else ()),
    )
    if not frame.layers:
        return Group(head, facts, Text("no router.expert_counts captured yet"))
    experts = max(len(ls.expert_tokens) for ls in frame.layers)
    table = Table(
        title=f"iteration {frame.load_iteration}: tokens per expert after capacity dropping",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    table.add_column("layer", justify="right")
    table.add_column("routed", justify="right")
    table.add_column(f"experts 0..{experts - 1}")
    table.add_column("max/mean", justify="right")
    table.add_column("dropped", justify="right")
    table.add_column("entropy", justify="right")
    for ls in frame.layers:
        load = (
            " ".join(f"{v:>4}" for v in ls.expert_tokens)
            if experts <= MAX_EXPERTS_AS_NUMBERS
            else f"{_bars(ls.expert_tokens)} {min(ls.expert_tokens)}..{max(ls.expert_tokens)}"
        )
        table.add_row(
            str(ls.layer),
            str(ls.tokens_routed),
            load,
            f"{ls.imbalance:.2f}",
            Text(f"{ls.drop_rate:.1%}", style="red" if ls.drop_rate > 0 else ""),
            "-" if ls.entropy is None else f"{ls.entropy:.3f}",
        )
    return Group(head, facts, table)


def cmd_watch(args) -> int:
    """``watch``: the live view of a run, refreshed until interrupted (``--once``: one frame)."""
    from rich.console import Console
    from rich.live import Live

    def frame() -> WatchFrame:
        return collect(args.store, args.database, args.run_id, entropy=not args.no_entropy)

    if args.interval <= 0:
        print(f"error: --interval must be a positive number of seconds, not {args.interval:g}", file=sys.stderr)
        return 2
    if args.json and not args.once:
        print("error: --json prints one frame: use it with --once", file=sys.stderr)
        return 2
    if args.once:
        f = frame()
        if args.json:
            print(json.dumps(dataclasses.asdict(f)))
        else:
            Console().print(render(f))
        return 0
    console = Console()
    with Live(render(frame(), args.interval), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(render(frame(), args.interval), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0


def _setup_watch(p: argparse.ArgumentParser) -> None:
    store_arg(p)
    run_arg(p)
    p.add_argument("--interval", type=float, default=3.0, help="seconds between refreshes (default: 3)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="with --once: the frame's numbers as one JSON object")
    p.add_argument(
        "--no-entropy",
        action="store_true",
        help="skip the router entropy (it decodes router.logits)",
    )
    p.set_defaults(func=cmd_watch)


add_subcommand("watch", _setup_watch, "a live view of a run while it trains (refreshed every few seconds)")
