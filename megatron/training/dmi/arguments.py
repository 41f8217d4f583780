"""The --dmi-* argument group, generated from DMIConfig's fields, and its translation back into a DMIConfig.

One flag per field: ``--dmi-`` and the field name with dashes, dest ``dmi_<field>``, the field's
docstring as help and its default as default; a field's parser (DMIConfig metadata ``parse``) is
the flag's argparse type. So every value is checked while Megatron parses its arguments (before any
process group or model exists), and bad input fails with one line naming the flag. Not generated:
``clickhouse_password`` (never a flag: it would sit in argv) and ``--dmi-clickhouse-password-file``
(how the password is given instead).
"""

from __future__ import annotations

import argparse
import os
import typing
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import Field, fields
from typing import NoReturn

from megatron.training.argument_utils import ArgumentGroupFactory

from megatron.core.dmi.catalog import ModelShape, UnsupportedUnderGraphsError, check_graph_support, record_bytes
from megatron.core.dmi.config import CaptureWindowError, DMIConfig, SpoolBoundError
from megatron.core.dmi.hooks import groups
from megatron.core.dmi.hooks.groups.base import ModelFacts
from megatron.core.dmi.store_address import PASSWORD_ENV, parse_store_run
from megatron.core.dmi.validators import ConfigValueError, argparse_type
from megatron.training.dmi.signals import seal_seconds

NOT_FLAGS = ("clickhouse_password",)
FLAG_FIELDS = tuple(f.name for f in fields(DMIConfig) if f.name not in NOT_FLAGS)


def dest_of(field_name: str) -> str:
    """Where argparse keeps a field's flag value in ``args``."""
    return f"dmi_{field_name}"


# Parsed values are plain sorted tuples, not frozensets: Megatron saves ``args`` inside every
# checkpoint and ``torch.load(weights_only=True)`` refuses a frozenset, which would make a DMI run's
# checkpoints unloadable (``--load``). DMIConfig's parsers turn them back into frozensets.
def _flag_value(value):
    return tuple(sorted(value)) if isinstance(value, frozenset) else value


def _flag_type(parse: Callable, host_check: Callable | None) -> Callable[[str], object]:
    """A field parser (and its host check) as an argparse type: its errors become argparse's one-line errors."""

    def parse_flag(text: str):
        value = parse(text)  # the field parsers raise ValueError subclasses that say why
        problem = host_check(value) if host_check else None
        if problem:
            raise ConfigValueError(problem)
        return _flag_value(value)

    return argparse_type(parse_flag)


class _DMIGroupFactory(ArgumentGroupFactory):
    """megatron-core's dataclass-to-argparse factory with DMI's flag names and field parsers."""

    def _extract_type(self, config_type: type) -> dict:
        if typing.get_origin(config_type) is frozenset:
            return {"type": str}  # a comma list: the field's parser makes the set
        return super()._extract_type(config_type)

    def _build_argparse_kwargs_from_field(self, attribute: Field) -> dict:
        kwargs = super()._build_argparse_kwargs_from_field(attribute)
        kwargs["arg_names"] = [self._format_arg_name(attribute.name, prefix="dmi")]
        kwargs["dest"] = dest_of(attribute.name)
        kwargs["default"] = _flag_value(kwargs["default"])
        if "parse" in attribute.metadata:
            kwargs["type"] = _flag_type(attribute.metadata["parse"], attribute.metadata.get("host_check"))
        if attribute.name == "store_dir":
            kwargs["default"] = None  # config_from_args puts it under --save when there is one
        return kwargs


def add_dmi_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``dmi`` argument group: one flag per DMIConfig field, and the password file.

    Args:
        parser: Megatron's parser (or any).

    Returns:
        ``parser``, for Megatron's ``extra_args_provider`` chain.
    """
    group = _DMIGroupFactory(DMIConfig, exclude=list(NOT_FLAGS)).build_group(parser, title="dmi")
    group.add_argument(
        "--dmi-clickhouse-password-file",
        default=None,
        help=f"file holding the ClickHouse password (else ${PASSWORD_ENV}; never a flag itself)",
    )
    return parser


def read_password(args: argparse.Namespace) -> str | None:
    """The server password from ``--dmi-clickhouse-password-file``, else the environment."""
    if args.dmi_clickhouse_password_file:
        with open(args.dmi_clickhouse_password_file, encoding="utf-8") as f:
            return f.read().strip()
    return os.environ.get(PASSWORD_ENV)


def config_from_args(args: argparse.Namespace) -> DMIConfig:
    """The DMIConfig of the parsed --dmi-* flags.

    Each field comes from its flag, by name (DMIConfig turns the tuples back into frozensets); only
    the store directory's default (under ``--save``) and the password (from its file or
    ``$DMI_CLICKHOUSE_PASSWORD``, and only with a server URL) are not copied.

    Args:
        args: the parsed arguments.

    Returns:
        The checked config.

    Raises:
        FlagRefusal: the capture window ends before it starts (naming ``--dmi-end-iter``), or a setting does not
            go with the others (naming its flag).
    """
    values = {name: getattr(args, dest_of(name)) for name in FLAG_FIELDS}
    values["store_dir"] = args.dmi_store_dir or os.path.join(getattr(args, "save", None) or "", DMIConfig.store_dir)
    values["clickhouse_password"] = read_password(args) if args.dmi_clickhouse_url else None
    try:
        return DMIConfig(**values)
    except CaptureWindowError as exc:
        refuse("--dmi-end-iter", str(exc))
    except SpoolBoundError as exc:
        refuse("--dmi-spool-max-gb", str(exc))


class FlagRefusal(SystemExit):
    """A flag value this run cannot honour. Its code is the line ``error: argument FLAG: why``;
    ``entry.flag_refusals_as_usage_errors`` reports it as argparse reports a bad argument, and as
    Megatron's own argument errors end: the one-line usage, ``<prog>: error: argument FLAG: why``,
    exit 2 (uncaught, Python prints the line and exits 1)."""


def refuse(flag: str, why: str) -> NoReturn:
    """Stop at start-up, naming ``flag`` and why its value cannot run (a ``FlagRefusal``)."""
    raise FlagRefusal(f"error: argument {flag}: {why}")


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The model's shape as the catalog needs it, from Megatron's arguments."""
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
        qk_head_dim=args.qk_head_dim + args.qk_pos_emb_head_dim if args.multi_latent_attention else 0,
        v_head_dim=args.v_head_dim if args.multi_latent_attention else 0,
        residual_itemsize=4 if args.fp32_residual_connection else 0,
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
    """Parallel layouts and model features DMI cannot capture correctly are refused before Megatron
    looks at them: context parallelism, and each selected hook group's own refusal (``groups.refusal``,
    which ``HookSet.attach`` runs too)."""
    if args.dmi_hooks and args.context_parallel_size > 1:
        refuse("--dmi-hooks", "context parallelism (--context-parallel-size > 1) is not supported by DMI yet")
    why = groups.refusal(frozenset(args.dmi_hooks), ModelFacts.of(args))
    if why is not None:
        refuse(*why)


# (flag, why --dmi-replay-routing cannot follow it), checked in order; each a predicate on the arguments
_REPLAY_REFUSALS = (
    ("--num-experts", lambda a: not a.num_experts, "routing replay needs a MoE model"),
    (
        "--cuda-graph-impl",
        lambda a: getattr(a, "cuda_graph_impl", "none") != "none",
        "routing replay under CUDA graphs is not supported yet",
    ),
    (
        "--moe-router-fusion",
        lambda a: getattr(a, "moe_router_fusion", False),
        "the fused router's top-k ignores megatron-core's RouterReplay",
    ),
    (
        "--moe-router-load-balancing-type",
        lambda a: "sinkhorn" in str(a.moe_router_load_balancing_type),
        "sinkhorn routing ignores megatron-core's RouterReplay",
    ),
    ("--mtp-num-layers", lambda a: bool(getattr(a, "mtp_num_layers", None)), "MTP layers' routers are not replayed"),
    ("--context-parallel-size", lambda a: a.context_parallel_size > 1, "context parallelism is not supported by DMI"),
)


def check_replay_args(args: argparse.Namespace) -> None:
    """``--dmi-replay-routing`` refuses, naming the flag, what it cannot replay exactly; the stored run
    itself is checked against this one when the model exists (megatron/core/dmi/replay)."""
    for flag, refused, why in _REPLAY_REFUSALS:
        if refused(args):
            refuse("--dmi-replay-routing", f"{why} ({flag})")
    store, _ = parse_store_run(args.dmi_replay_routing)
    if "://" not in store and not os.path.isdir(store):
        refuse("--dmi-replay-routing", f"no DMI store at {store!r} (directory does not exist)")


def validate_dmi_args(args: argparse.Namespace) -> None:
    """Checks that need the whole Megatron config; run right after Megatron validates its own."""
    if args.dmi_replay_routing:
        check_replay_args(args)
    if not args.dmi_hooks:
        return
    seal_seconds()  # a bad $DMI_SIGNAL_SEAL_SECONDS stops the run here, not when DMI starts
    shape = model_shape(args)
    beyond = [layer for layer in args.dmi_layers or () if layer >= args.num_layers]
    if beyond:
        refuse(
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
        refuse(
            "--dmi-ring-mb",
            f"{args.dmi_ring_mb} MiB cannot hold one record of {largest} bytes; use at least {largest / (1 << 20):.2f}",
        )
    if args.dmi_clickhouse_password_file and not os.access(args.dmi_clickhouse_password_file, os.R_OK):
        refuse("--dmi-clickhouse-password-file", f"cannot read {args.dmi_clickhouse_password_file!r}")
    if args.dmi_persist == "clickhouse" and args.dmi_clickhouse_url:
        why = _ping(args.dmi_clickhouse_url)
        if why is not None:
            refuse(
                "--dmi-clickhouse-url",
                f"ClickHouse at {args.dmi_clickhouse_url} is unreachable ({why}); "
                "fix the URL or use --dmi-persist spool and load the spool later",
            )
    if getattr(args, "cuda_graph_impl", "none") != "none":
        try:
            check_graph_support(frozenset(args.dmi_hooks))
        except UnsupportedUnderGraphsError as exc:
            refuse("--dmi-hooks", str(exc))
        if args.dmi_transport == "torch":
            refuse(
                "--dmi-transport",
                "CUDA graphs (--cuda-graph-impl) need the native transport (its device gate "
                "and context block replay with the graph); use native or auto",
            )
        if args.dmi_record_replays:
            refuse(
                "--dmi-record-replays",
                "recompute replays cannot be recorded under CUDA graphs; they are rejected by the device gate",
            )
        if "full_iteration" in [getattr(s, "name", s) for s in (getattr(args, "cuda_graph_scope", None) or [])]:
            refuse(
                "--cuda-graph-scope",
                "full_iteration graphs replay every microbatch's forward without Python, so DMI cannot tell "
                "the microbatches apart; graph per layer or per sub-layer scope (attn, mlp, moe, moe_router, "
                "moe_preprocess, or none for whole layers) instead",
            )
    store_dir = config_from_args(args).store_dir
    if os.path.exists(store_dir) and not os.path.isdir(store_dir):
        refuse("--dmi-store-dir", f"{store_dir!r} is a file; name a folder (created if missing) for DMI's store")
    try:
        os.makedirs(store_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        refuse("--dmi-store-dir", f"cannot create {store_dir!r}: {exc.strerror}")
