"""The --dmi-* group is generated from DMIConfig: one flag per field with the field's docstring as
help and its default as default, and config_from_args gives back exactly the values given."""

import argparse
import contextlib
import dataclasses
import io
import sys
from unittest import mock

import pytest
import torch

from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.hooks import groups
from megatron.core.dmi.hooks.groups.base import ModelFacts
from megatron.training.dmi.arguments import (
    FLAG_FIELDS,
    add_dmi_args,
    check_dmi_layout,
    config_from_args,
    validate_dmi_args,
)

PASSWORD_FILE_FLAG = "--dmi-clickhouse-password-file"


def _parser() -> argparse.ArgumentParser:
    return add_dmi_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))


def _dmi_actions() -> dict[str, argparse.Action]:
    return {o: a for a in _parser()._actions for o in a.option_strings if o.startswith("--dmi-")}


def _flag(name: str) -> str:
    return "--dmi-" + name.replace("_", "-")


def test_every_field_but_the_password_is_one_flag_and_no_flag_is_hand_written():
    names = [f.name for f in dataclasses.fields(DMIConfig)]
    assert list(FLAG_FIELDS) == [n for n in names if n != "clickhouse_password"]
    assert set(_dmi_actions()) == {_flag(n) for n in FLAG_FIELDS} | {PASSWORD_FILE_FLAG}


@pytest.mark.parametrize("name", FLAG_FIELDS)
def test_a_flag_has_the_fields_dest_help_and_default(name):
    action = _dmi_actions()[_flag(name)]
    field = next(f for f in dataclasses.fields(DMIConfig) if f.name == name)
    assert action.option_strings == [_flag(name)] and action.dest == f"dmi_{name}"
    assert action.help and len(action.help) > 10
    if name == "store_dir":  # derived from --save when not given
        assert action.default is None
    elif isinstance(field.default, frozenset):  # kept as a sorted tuple in args (checkpoints load it)
        assert action.default == tuple(sorted(field.default))
    else:
        assert action.default == field.default


# field -> (flag text, the field's value after the round trip); every value differs from the default
GIVEN = {
    "hooks": ("router,attn.q", parse_hooks("router,attn.q")),
    "persist": ("spool", "spool"),
    "store_dir": ("/data/dmi", "/data/dmi"),
    "clickhouse_url": ("https://reader@db.example:8443", "https://reader@db.example:8443"),
    "clickhouse_database": ("runs_2", "runs_2"),
    "store_codec": ("zstd1", "zstd1"),
    "ingest_threads": ("3", 3),
    "ingest_nice": ("5", 5),
    "interval": ("3", 3),
    "start_iter": ("2", 2),
    "end_iter": ("9", 9),
    "layers": ("0,2-3", frozenset({0, 2, 3})),
    "phases": ("train,valid", frozenset({"train", "valid"})),
    "ring_mb": ("1.5", 1.5),
    "on_full": ("drop", "drop"),
    "block_timeout": ("2.5", 2.5),
    "transport": ("torch", "torch"),
    "record_replays": (None, True),  # a switch
    "run_id": ("exp-1.a", "exp-1.a"),
    "flush_records": ("64", 64),
    "logits_topk": ("16", 16),
    "replay_routing": ("/data/dmi@run-1", "/data/dmi@run-1"),
    "replay_missing": ("live", "live"),
}
# Flags whose given value cannot go with GIVEN's (the spool bound needs the default --dmi-persist).
GIVEN_ALONE = {"spool_max_gb": ("2.5", 2.5)}


def test_every_flag_round_trips_into_the_config(monkeypatch):
    assert set(GIVEN) | set(GIVEN_ALONE) == set(FLAG_FIELDS)
    monkeypatch.setenv("DMI_CLICKHOUSE_PASSWORD", "from-env")
    argv = []
    for name, (text, _) in GIVEN.items():
        argv += [_flag(name)] if text is None else [_flag(name), text]
    ns = _parser().parse_args(argv)
    # Megatron saves args in checkpoints; a weights_only load must accept every DMI value.
    buf = io.BytesIO()
    torch.save({k: v for k, v in vars(ns).items() if k.startswith("dmi_")}, buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
    config = config_from_args(ns)
    defaults = DMIConfig()
    for name, (_, value) in GIVEN.items():
        assert value != getattr(defaults, name), name
        assert getattr(config, name) == value, name
        assert type(getattr(config, name)) is type(value), name
    assert config.clickhouse_password == "from-env"
    for name, (text, value) in GIVEN_ALONE.items():
        ns = _parser().parse_args([_flag(name), text])
        ns.save = None
        assert getattr(config_from_args(ns), name) == value != getattr(defaults, name), name


def test_defaults_give_the_default_config_with_the_store_under_save():
    ns = _parser().parse_args([])
    ns.save = None
    assert config_from_args(ns) == DMIConfig()
    ns.save = "/ckpt"
    assert config_from_args(ns).store_dir == "/ckpt/dmi_store"


def test_the_password_comes_from_its_file_and_only_with_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("DMI_CLICKHOUSE_PASSWORD", "from-env")
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    ns = _parser().parse_args(["--dmi-clickhouse-url", "http://h:8123", PASSWORD_FILE_FLAG, str(secret)])
    assert config_from_args(ns).clickhouse_password == "from-file"
    assert config_from_args(_parser().parse_args([PASSWORD_FILE_FLAG, str(secret)])).clickhouse_password is None


# The one-line errors are the same as before the group was generated.
BAD = [
    ("--dmi-hooks", "router,bogus", "unknown hook 'bogus' (known: all, none, "),
    ("--dmi-hooks", "router,", "empty item in hook list 'router,'"),
    ("--dmi-interval", "0", "expected a positive integer, got '0'"),
    ("--dmi-start-iter", "x", "expected a positive integer, got 'x'"),
    ("--dmi-flush-records", "-1", "expected a positive integer, got '-1'"),
    ("--dmi-logits-topk", "1.5", "expected a positive integer, got '1.5'"),
    ("--dmi-layers", "4-1", "empty layer range '4-1' in '4-1' (end before start)"),
    ("--dmi-layers", "a", "malformed layer range 'a' in 'a' (expected e.g. 0,4-7)"),
    ("--dmi-layers", "0-99999999999", "layer '99999999999' in '0-99999999999' is out of range (0..65535)"),
    ("--dmi-phases", "train,test", "unknown phase(s) ['test'] in 'train,test' (known: train, valid)"),
    ("--dmi-ring-mb", "abc", "expected a size in MiB, got 'abc'"),
    ("--dmi-ring-mb", "0", "ring size must hold at least one 256-byte slot, got '0' MiB"),
    ("--dmi-ring-mb", "nan", "ring size must hold at least one 256-byte slot, got 'nan' MiB"),
    ("--dmi-block-timeout", "0", "expected seconds above 0 and at most 604800 (a week), got '0'"),
    ("--dmi-block-timeout", "1e9", "expected seconds above 0 and at most 604800 (a week), got '1e9'"),
    ("--dmi-block-timeout", "soon", "expected a number of seconds, got 'soon'"),
    ("--dmi-on-full", "wait", "invalid choice: 'wait' (choose from "),
    ("--dmi-spool-max-gb", "0", "expected a size in GiB above 0, got '0'"),
    ("--dmi-spool-max-gb", "a lot", "expected a size in GiB, got 'a lot'"),
    ("--dmi-persist", "s3", "invalid choice: 's3' (choose from "),
    ("--dmi-clickhouse-url", "ftp://h:1", "expected http(s)://host:port, got 'ftp://h:1'"),
    ("--dmi-clickhouse-url", "http://h:x", "bad port in 'http://h:x'"),
    ("--dmi-clickhouse-url", "http://h:1/x", "takes only http(s)://[user@]host:port"),
    (
        "--dmi-clickhouse-url",
        "http://u:p@h:1",
        "put the password in $DMI_CLICKHOUSE_PASSWORD or --dmi-clickhouse-password-file, not in the URL",
    ),
    ("--dmi-clickhouse-database", "system", "database name 'system' is reserved by ClickHouse"),
    ("--dmi-run-id", "..", "run id must be 1-128 ASCII letters, digits, '.', '_' or '-', starting with"),
]


@pytest.mark.parametrize("flag,value,message", BAD, ids=[f"{f} {v}" for f, v, _ in BAD])
def test_a_bad_value_is_one_argparse_error_line_naming_the_flag(flag, value, message):
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        _parser().parse_args([f"{flag}={value}"])
    assert e.value.code == 2
    last = err.getvalue().strip().splitlines()[-1]
    assert last.startswith(f"pretrain_gpt.py: error: argument {flag}: {message}"), last


def test_an_end_before_the_start_stops_with_the_end_flag_named():
    ns = _parser().parse_args(["--dmi-start-iter", "5", "--dmi-end-iter", "3"])
    with pytest.raises(SystemExit) as e:
        config_from_args(ns)
    assert str(e.value.code) == "error: argument --dmi-end-iter: 3 is before --dmi-start-iter 5"


def test_a_spool_bound_without_a_store_stops_with_the_bound_flag_named():
    ns = _parser().parse_args(["--dmi-persist", "spool", "--dmi-spool-max-gb", "4"])
    with pytest.raises(SystemExit) as e:
        config_from_args(ns)
    assert str(e.value.code) == (
        "error: argument --dmi-spool-max-gb: bounds the spool that a store takes away, and --dmi-persist spool "
        "has none (a spool-only run keeps every segment by design)"
    )


def _megatron_args(*extra: str) -> argparse.Namespace:
    """Megatron's own parse of the tiny MoE model's arguments plus ``extra``, with the DMI group."""
    from megatron.training.arguments import parse_args

    from tests.functional_tests.launch import tiny_moe_args

    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *tiny_moe_args(), *extra]):
        return parse_args(extra_args_provider=add_dmi_args, ignore_unknown_args=False)


def _exit_message(check, args) -> str:
    with pytest.raises(SystemExit) as e:
        check(args)
    return str(e.value.code)


@pytest.mark.parametrize("target", [(), ("--dmi-clickhouse-url", "http://h:8123")])
def test_the_ingesters_threads_are_one_flag_for_either_store(target, monkeypatch):
    monkeypatch.delenv("DMI_CLICKHOUSE_PASSWORD", raising=False)
    assert config_from_args(_megatron_args(*target, "--dmi-ingest-threads", "2")).ingest_threads == 2
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        _megatron_args(*target, "--dmi-ingest-streams", "2")  # folded into --dmi-ingest-threads
    assert e.value.code == 2
    assert err.getvalue().strip().splitlines()[-1].endswith("error: unrecognized arguments: --dmi-ingest-streams 2")


# resid.in of the tiny model: [32, 2, 64] per microbatch, 8,192 bytes in bf16 and 16,384 in fp32; the
# ring below (13,107 bytes) holds the first and not the second.
@pytest.mark.parametrize("hook", ["resid.in", "resid.out", "grad.resid_in"])
def test_the_ring_size_check_uses_the_fp32_residual_stream(tmp_path, hook):
    common = ("--bf16", "--dmi-hooks", hook, "--dmi-ring-mb", "0.0125", "--dmi-store-dir", str(tmp_path))
    validate_dmi_args(_megatron_args(*common))
    message = _exit_message(validate_dmi_args, _megatron_args(*common, "--fp32-residual-connection"))
    assert message == (
        "error: argument --dmi-ring-mb: 0.0125 MiB cannot hold one record of 16384 bytes; use at least 0.02"
    )


def test_the_sub_layer_outputs_stay_in_the_model_dtype_with_an_fp32_residual_stream(tmp_path):
    validate_dmi_args(
        _megatron_args(
            "--bf16",
            "--fp32-residual-connection",
            "--dmi-hooks",
            "mlp.out",
            "--dmi-ring-mb",
            "0.0125",
            "--dmi-store-dir",
            str(tmp_path),
        )
    )


# (extra arguments, the flag named, the reason's start): each group's refusal, as the flags see it
REFUSED = [
    (("--dmi-hooks", "router", "--num-experts", "0"), "--dmi-hooks", "router outputs need a MoE model"),
    (("--dmi-hooks", "logits", "--mtp-num-layers", "1"), "--dmi-hooks", "logits outputs are not supported"),
    (
        ("--dmi-hooks", "mlp.experts", "--moe-expert-capacity-factor", "1.0"),
        "--moe-expert-capacity-factor",
        "mlp.experts does not support token dropping",
    ),
    (
        ("--dmi-hooks", "mlp.experts", "--moe-token-dispatcher-type", "flex"),
        "--moe-token-dispatcher-type",
        "mlp.experts needs the allgather or alltoall",
    ),
    (
        ("--dmi-hooks", "mlp.experts", "--tensor-model-parallel-size", "2"),
        "--sequence-parallel",
        "mlp.experts needs sequence parallelism",
    ),
    (
        ("--dmi-hooks", "mlp.shared", "--moe-shared-expert-overlap"),
        "--dmi-hooks",
        "mlp.shared is not supported with --moe-shared-expert-overlap",
    ),
    (("--dmi-hooks", "attn", "--context-parallel-size", "2"), "--dmi-hooks", "context parallelism"),
]


@pytest.mark.parametrize("extra,flag,reason", REFUSED, ids=[" ".join(e) for e, _, _ in REFUSED])
def test_each_groups_refusal_names_the_flag_at_start_up(extra, flag, reason):
    args = _megatron_args(*extra)
    assert _exit_message(check_dmi_layout, args).startswith(f"error: argument {flag}: {reason}")
    if flag != "--dmi-hooks" or "context" not in reason:  # context parallelism concerns every group
        assert groups.refusal(frozenset(args.dmi_hooks), ModelFacts.of(args))[0] == flag


def test_a_supported_selection_passes_the_start_up_checks():
    check_dmi_layout(_megatron_args("--dmi-hooks", "all,mlp.experts,logits.full,grad"))
