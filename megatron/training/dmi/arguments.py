"""The --dmi-* argument group and its translation into a DMIConfig.

Every value is checked by its argparse ``type``, so bad input fails while Megatron parses its
arguments (before any process group or model exists) with one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
import urllib.parse
import urllib.request

from megatron.core.dmi.catalog import (
    BY_NAME,
    HookSelectionError,
    ModelShape,
    UnsupportedUnderGraphsError,
    check_graph_support,
    parse_hooks,
    record_bytes,
)
from megatron.core.dmi.cli import database_arg
from megatron.core.dmi.config import DMIConfig, LayerRangeError, RunIdError, check_run_id, parse_layers
from megatron.core.dmi.records import PHASES
from megatron.core.dmi.transport.base import SLOT_ALIGN

PASSWORD_ENV = "DMI_CLICKHOUSE_PASSWORD"


# Parsed values are plain sorted tuples, not frozensets: Megatron saves ``args`` inside every
# checkpoint and ``torch.load(weights_only=True)`` refuses a frozenset, which would make a DMI run's
# checkpoints unloadable (``--load``). config_from_args turns them into frozensets.
def _hooks(value: str) -> tuple[str, ...]:
    try:
        return tuple(sorted(parse_hooks(value)))
    except HookSelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


MAX_LAYER = 1 << 16


def _layers(value: str) -> tuple[int, ...] | None:
    # Bound every number first: "0-99999999999" must be an error, not a set of 10^11 layers.
    for num in "".join(c if c.isdigit() else " " for c in value).split():
        if len(num) > 6 or int(num) >= MAX_LAYER:
            raise argparse.ArgumentTypeError(
                f"layer {num[:12]!r} in {value[:80]!r} is out of range (0..{MAX_LAYER - 1})"
            )
    try:
        layers = parse_layers(value)
        return None if layers is None else tuple(sorted(layers))
    except LayerRangeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def ring_memory_problem(mb: float) -> str | None:
    """Why a ring of ``mb`` MiB cannot be allocated here, or None. Host memory must hold the ring
    and its staging copy (host ring) or the pinned staging copy (CUDA ring); a CUDA ring must also
    fit the device's free memory, known only once CUDA is initialised (never initialised here)."""
    import torch

    host_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20)
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's processes on this machine, one ring each
    limit = host_mib / (2 * procs)
    if mb > limit:
        return (
            f"{mb:g} MiB does not fit this machine: the ring and its staging copy of each of its {procs} "
            f"process(es) need twice that in host memory, which is {host_mib:.0f} MiB; use at most {limit:.0f}"
        )
    if torch.cuda.is_initialized():  # never initialise CUDA here (before Megatron sets the device)
        free, _ = torch.cuda.mem_get_info()
        if mb * (1 << 20) > free:
            return (
                f"{mb:g} MiB does not fit the free memory of cuda:{torch.cuda.current_device()}, "
                f"{free / (1 << 20):.0f} MiB"
            )
    return None


def _ring_mb(value: str) -> float:
    try:
        mb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MiB, got {value!r}") from None
    if not mb * (1 << 20) >= SLOT_ALIGN or mb != mb or mb == float("inf"):
        raise argparse.ArgumentTypeError(f"ring size must hold at least one {SLOT_ALIGN}-byte slot, got {value!r} MiB")
    why = ring_memory_problem(mb)
    if why:
        raise argparse.ArgumentTypeError(why)
    return mb


def _phases(value: str) -> tuple[str, ...]:
    phases = frozenset(p.strip() for p in value.split(","))
    unknown = phases - set(PHASES)
    if unknown or not phases:
        raise argparse.ArgumentTypeError(
            f"unknown phase(s) {sorted(unknown)} in {value!r} (known: {', '.join(PHASES)})"
        )
    return tuple(sorted(phases))


def _clickhouse_url(value: str) -> str:
    from megatron.core.dmi.sinks.backend import ServerURLError, parse_server_url, redact

    shown = redact(value, None)  # never echo a user:password@ part back
    try:
        url = urllib.parse.urlsplit(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected http(s)://host:port, got {shown!r} ({exc})") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(f"expected http(s)://host:port, got {shown!r}")
    if url.password is not None:
        raise argparse.ArgumentTypeError(
            f"put the password in ${PASSWORD_ENV} or --dmi-clickhouse-password-file, not in the URL"
        )
    try:
        _ = url.port  # urllib parses the port lazily: ask for it to validate it
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {shown!r}") from None
    try:
        parse_server_url(value)
    except ServerURLError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--dmi-clickhouse-url ")) from None
    return value


def _run_id(value: str) -> str:
    try:
        return check_run_id(value)
    except RunIdError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_dmi_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("dmi", "Deep Model Inspection: capture model internals while training")
    g.add_argument(
        "--dmi-hooks",
        type=_hooks,
        default=(),
        help="comma list of hook groups or outputs (router, attn, router.logits, attn.q, ..., all, none); "
        "default none: DMI is off",
    )
    g.add_argument(
        "--dmi-persist",
        choices=("clickhouse", "spool", "none"),
        default="clickhouse",
        help="clickhouse: embedded chDB under --dmi-store-dir, or a server with --dmi-clickhouse-url; "
        "spool: local spool segments only (loadable later with `load`); none: capture and transport, store nothing",
    )
    g.add_argument(
        "--dmi-store-dir",
        default=None,
        help="store and spool directory (default: <--save>/dmi_store, else ./dmi_store)",
    )
    g.add_argument(
        "--dmi-clickhouse-url",
        type=_clickhouse_url,
        default=None,
        help=f"ClickHouse server http(s)://host:port (password from ${PASSWORD_ENV} or the file flag)",
    )
    g.add_argument(
        "--dmi-clickhouse-database",
        type=database_arg,
        default="dmi",
        help="database name, in the server or the embedded store (letters, digits, '_')",
    )
    g.add_argument("--dmi-clickhouse-password-file", default=None, help="file holding the ClickHouse password")
    g.add_argument("--dmi-interval", type=_positive_int, default=1, help="capture every N-th iteration")
    g.add_argument("--dmi-start-iter", type=_positive_int, default=1, help="first captured iteration (1-based)")
    g.add_argument("--dmi-end-iter", type=_positive_int, default=None, help="last captured iteration")
    g.add_argument("--dmi-layers", type=_layers, default=None, help="global 0-based layers, e.g. 0,4-7 (default all)")
    g.add_argument("--dmi-phases", type=_phases, default=("train",), help="phases captured: train,valid")
    g.add_argument("--dmi-ring-mb", type=_ring_mb, default=64.0, help="payload ring size per process in MiB")
    g.add_argument(
        "--dmi-on-full",
        choices=("block", "drop"),
        default="block",
        help="ring full: block the producer until space frees, or drop (counted, logged, stored)",
    )
    g.add_argument(
        "--dmi-transport",
        choices=("auto", "native", "torch"),
        default="auto",
        help="native: JIT-built ring kernels; torch: pure-PyTorch ring; auto: native if it builds",
    )
    g.add_argument(
        "--dmi-record-replays",
        action="store_true",
        help="keep activation-recompute replays as invocation 1 instead of rejecting them",
    )
    g.add_argument("--dmi-run-id", type=_run_id, default=None, help="run id (default: generated; kept on resume)")
    g.add_argument("--dmi-logits-topk", type=_positive_int, default=8, help="k of the logits.topk output")
    return parser


def read_password(args: argparse.Namespace) -> str | None:
    if args.dmi_clickhouse_password_file:
        with open(args.dmi_clickhouse_password_file, encoding="utf-8") as f:
            return f.read().strip()
    return os.environ.get(PASSWORD_ENV)


def config_from_args(args: argparse.Namespace) -> DMIConfig:
    store_dir = args.dmi_store_dir or (
        os.path.join(args.save, "dmi_store") if getattr(args, "save", None) else "dmi_store"
    )
    if args.dmi_end_iter is not None and args.dmi_end_iter < args.dmi_start_iter:
        _fail("--dmi-end-iter", f"{args.dmi_end_iter} is before --dmi-start-iter {args.dmi_start_iter}")
    return DMIConfig(
        hooks=frozenset(args.dmi_hooks),
        persist=args.dmi_persist,
        store_dir=store_dir,
        clickhouse_url=args.dmi_clickhouse_url,
        clickhouse_database=args.dmi_clickhouse_database,
        clickhouse_password=read_password(args) if args.dmi_clickhouse_url else None,
        interval=args.dmi_interval,
        start_iter=args.dmi_start_iter,
        end_iter=args.dmi_end_iter,
        layers=None if args.dmi_layers is None else frozenset(args.dmi_layers),
        phases=frozenset(args.dmi_phases),
        ring_mb=args.dmi_ring_mb,
        on_full=args.dmi_on_full,
        transport=args.dmi_transport,
        record_replays=args.dmi_record_replays,
        run_id=args.dmi_run_id,
        logits_topk=args.dmi_logits_topk,
    )


def _fail(flag: str, message: str) -> None:
    raise SystemExit(f"error: argument {flag}: {message}")


def model_shape(args: argparse.Namespace) -> ModelShape:
    heads = args.num_attention_heads
    itemsize = 2 if (args.bf16 or args.fp16) else 4
    return ModelShape(
        seq_length=args.seq_length,
        micro_batch=args.micro_batch_size,
        num_experts=args.num_experts or 0,
        topk=args.moe_router_topk,
        heads=heads,
        query_groups=args.num_query_groups if args.group_query_attention else heads,
        head_dim=args.kv_channels or args.hidden_size // heads,
        tp=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        router_itemsize={"fp32": 4, "fp64": 8}.get(args.moe_router_dtype, itemsize),
        model_itemsize=itemsize,
        hidden=args.hidden_size,
        vocab=getattr(args, "padded_vocab_size", None) or args.vocab_size or 0,
        logits_topk=args.dmi_logits_topk,
    )


def _ping(url: str) -> str | None:
    """None if the server answers /ping, else why not."""
    u = urllib.parse.urlsplit(url)
    host = f"[{u.hostname}]" if ":" in (u.hostname or "") else u.hostname
    port = u.port or (8443 if u.scheme == "https" else 8123)
    ping = f"{u.scheme}://{host}:{port}/ping"  # without user@: /ping needs no credentials
    try:
        with urllib.request.urlopen(ping, timeout=5) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


def check_dmi_layout(args: argparse.Namespace) -> None:
    """Parallel layouts and model features DMI cannot capture correctly are refused before Megatron looks at them."""
    if args.dmi_hooks and args.context_parallel_size > 1:
        _fail("--dmi-hooks", "context parallelism (--context-parallel-size > 1) is not supported by DMI yet")
    if any(BY_NAME[o].group == "logits" for o in args.dmi_hooks) and getattr(args, "mtp_num_layers", None):
        _fail("--dmi-hooks", "logits outputs are not supported with multi-token prediction (--mtp-num-layers)")
    if "mlp.shared" in args.dmi_hooks and getattr(args, "moe_shared_expert_overlap", False):
        _fail(
            "--dmi-hooks",
            "mlp.shared is not supported with --moe-shared-expert-overlap (the shared expert runs "
            "inside the token dispatcher there)",
        )


def validate_dmi_args(args: argparse.Namespace) -> None:
    """Checks that need the whole Megatron config; run right after Megatron validates its own."""
    if not args.dmi_hooks:
        return
    shape = model_shape(args)
    # router.weight (group resid) just has no layer to record on a dense model
    if any(BY_NAME[o].group == "router" for o in args.dmi_hooks) and not args.num_experts:
        _fail("--dmi-hooks", "router outputs need a MoE model (--num-experts)")
    beyond = [layer for layer in args.dmi_layers or () if layer >= args.num_layers]
    if beyond:
        _fail(
            "--dmi-layers",
            f"layer(s) {', '.join(map(str, beyond))} not in this model: --num-layers "
            f"{args.num_layers} has layers 0-{args.num_layers - 1}",
        )
    if "logits.full" in args.dmi_hooks and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"DMI warning: --dmi-hooks logits.full stores every output logit: {record_bytes('logits.full', shape):,} "
            "bytes per microbatch per tensor-parallel rank; logits.topk and logits.target are the small views",
            flush=True,
        )
    largest = max(record_bytes(o, shape) for o in args.dmi_hooks)
    if largest > args.dmi_ring_mb * (1 << 20):
        _fail(
            "--dmi-ring-mb",
            f"{args.dmi_ring_mb} MiB cannot hold one record of {largest} bytes; use at least {largest / (1 << 20):.2f}",
        )
    if args.dmi_clickhouse_password_file and not os.access(args.dmi_clickhouse_password_file, os.R_OK):
        _fail("--dmi-clickhouse-password-file", f"cannot read {args.dmi_clickhouse_password_file!r}")
    if args.dmi_persist == "clickhouse" and args.dmi_clickhouse_url:
        why = _ping(args.dmi_clickhouse_url)
        if why is not None:
            _fail(
                "--dmi-clickhouse-url",
                f"ClickHouse at {args.dmi_clickhouse_url} is unreachable ({why}); "
                "fix the URL or use --dmi-persist spool and load the spool later",
            )
    if getattr(args, "cuda_graph_impl", "none") != "none":
        try:
            check_graph_support(frozenset(args.dmi_hooks))
        except UnsupportedUnderGraphsError as exc:
            _fail("--dmi-hooks", str(exc))
        if args.dmi_transport == "torch":
            _fail(
                "--dmi-transport",
                "CUDA graphs (--cuda-graph-impl) need the native transport (its device gate "
                "and context block replay with the graph); use native or auto",
            )
        if args.dmi_record_replays:
            _fail(
                "--dmi-record-replays",
                "recompute replays cannot be recorded under CUDA graphs; they are rejected by the device gate",
            )
        if "full_iteration" in [getattr(s, "name", s) for s in (getattr(args, "cuda_graph_scope", None) or [])]:
            _fail(
                "--cuda-graph-scope",
                "full_iteration graphs replay every microbatch's forward without Python, so DMI cannot tell "
                "the microbatches apart; graph per layer or per sub-layer scope (attn, mlp, moe, moe_router, "
                "moe_preprocess, or none for whole layers) instead",
            )
    store_dir = config_from_args(args).store_dir
    try:
        os.makedirs(store_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        _fail("--dmi-store-dir", f"cannot create {store_dir!r}: {exc.strerror}")
