"""Bad input (issue 7): property-based fuzzing of the --dmi-* group (only clean argparse errors,
exit code 2, never a traceback) and hostile identifiers (rejected before any SQL is built)."""

import argparse
import contextlib
import io
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store_address import IdentifierError, check_identifier
from megatron.training.dmi.arguments import add_dmi_args, config_from_args
from tests.functional_tests.launch import REPO, tiny_moe_args

HERE = os.path.dirname(os.path.abspath(__file__))


def _parser():
    return add_dmi_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))


VALUE_FLAGS = [a for a in _parser()._actions if any(o.startswith("--dmi-") for o in a.option_strings) and a.nargs != 0]
HOSTILE = st.sampled_from(
    [
        "",
        " ",
        "-1",
        "0",
        "nan",
        "inf",
        "-inf",
        "1e400",
        "1e-400",
        "9" * 5000,
        "0x10",
        "٣",
        "²",
        "0-99999999999",
        "router,",
        ",",
        "all,none",
        "router;DROP TABLE x",
        "dmi'; DROP DATABASE dmi; --",
        "`dmi`",
        "a.b",
        "\x00",
        "\n",
        "http://",
        "http://:80",
        "http://h:99999",
        "http://h:-1",
        "http://u:p@h:1",
        "ftp://h:1",
        "http://[::1",
        "http://h:1/x",
        "http://h:1?q=1",
        "../../etc/passwd",
        "4-2",
        "0,4-7",
        "train,valid",
        "valid",
        "train,test",
        "x" * 200,
    ]
)
VALUES = st.one_of(
    HOSTILE, st.text(max_size=40), st.integers(-(10**30), 10**30).map(str), st.floats(allow_nan=True).map(str)
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(VALUE_FLAGS), VALUES), min_size=1, max_size=4))
def test_fuzzed_dmi_values_parse_or_fail_cleanly(pairs):
    argv = []
    for action, value in pairs:
        argv.append(f"{action.option_strings[0]}={value}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = _parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        msg = err.getvalue()
        assert "error: argument --dmi-" in msg and "Traceback" not in msg, msg
        if "argument --dmi-clickhouse-url" in msg:
            assert "p@h" not in msg  # a password in a URL is never echoed
        return
    # accepted: the config builds (or a start-up refusal, a clean SystemExit with a message)
    ns.save = None
    try:
        cfg = config_from_args(ns)
    except SystemExit as e:
        assert str(e.code).startswith("error: argument --dmi-")
        return
    check_identifier(cfg.clickhouse_database)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=80))
def test_identifiers_are_plain_or_rejected(name):
    try:
        check_identifier(name, "database name")
    except IdentifierError:
        return
    assert name.isascii() and all(c.isalnum() or c == "_" for c in name) and not name[0].isdigit()


HOSTILE_NAMES = [
    "dmi;DROP TABLE x",
    "dmi'",
    'dmi"',
    "dmi`",
    "dmi.tensors",
    "dmi tensors",
    "dmi--",
    "1dmi",
    "",
    "dmі",
]  # the last one has a Cyrillic i


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_database_names_are_rejected_everywhere(name, tmp_path):
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            _parser().parse_args(["--dmi-clickhouse-database", name])
    with pytest.raises(IdentifierError):
        S.qualified(name, "tensors")
    with pytest.raises(IdentifierError):
        S.qualified("dmi", name)
    from megatron.core.dmi.store.backend import ServerBackend

    with pytest.raises(IdentifierError):
        ServerBackend("http://127.0.0.1:1", name)


def test_hostile_database_name_in_a_real_run_and_in_the_cli(tmp_path):
    store = str(tmp_path / "store")
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "pretrain_gpt.py"),
            *tiny_moe_args(),
            "--cpu-dev-mode",
            "--dmi-hooks",
            "router",
            "--dmi-store-dir",
            store,
            "--dmi-clickhouse-database",
            "dmi; DROP DATABASE system",
        ],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=300,
    )
    assert p.returncode == 2
    assert "error: argument --dmi-clickhouse-database: invalid database name" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout and not os.path.exists(store)
    os.makedirs(store)
    p = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", "show", store, "--database", "x'; DROP TABLE y"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 2 and "invalid database name" in p.stderr and "Traceback" not in p.stderr


# -- inputs that passed validation and did harm (issue 17 item 5) ----------------------------------
def _parse_error(argv):
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        _parser().parse_args(argv)
    assert e.value.code == 2
    return err.getvalue()


@pytest.mark.parametrize("name", ["system", "information_schema", "INFORMATION_SCHEMA", "System"])
def test_reserved_databases_are_refused_by_the_flag_the_backends_and_the_cli(name, tmp_path):
    msg = _parse_error(["--dmi-clickhouse-database", name])
    assert f"error: argument --dmi-clickhouse-database: database name {name!r} is reserved by ClickHouse" in msg, msg
    from megatron.core.dmi.store.backend import ServerBackend

    with pytest.raises(IdentifierError, match="reserved"):
        ServerBackend("http://127.0.0.1:1", name)
    os.makedirs(tmp_path / "store")
    for argv in (["show", str(tmp_path / "store")], ["load", str(tmp_path), "--store", str(tmp_path / "store")]):
        p = subprocess.run(
            [sys.executable, "-m", "megatron.core.dmi", *argv, "--database", name],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        assert p.returncode == 2 and "argument --database" in p.stderr and "reserved" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.parametrize("run_id", ["..", ".", "../x", "a/b", "a\\b", "/abs", ".hidden", "-x", "x" * 129, "rün"])
def test_run_ids_that_are_not_one_plain_path_component_are_refused(run_id):
    msg = _parse_error([f"--dmi-run-id={run_id}"])
    assert "error: argument --dmi-run-id: run id must be 1-128 ASCII letters" in msg, msg
    from megatron.core.dmi.config import DMIConfig, RunIdError

    with pytest.raises(RunIdError):
        DMIConfig(run_id=run_id)


def _host_mib():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20)


@pytest.mark.parametrize("mb", ["1e300", "1.7e308", "host*2", "host/2+1"])
def test_ring_larger_than_host_memory_is_refused_with_the_limit(mb):
    host = _host_mib()
    value = {"host*2": str(host * 2), "host/2+1": str(int(host / 2) + 1)}.get(mb, mb)
    msg = _parse_error(["--dmi-ring-mb", value])
    assert "error: argument --dmi-ring-mb:" in msg and "does not fit this machine" in msg, msg
    assert f"use at most {host / 2:.0f}" in msg, msg
    assert _parser().parse_args(["--dmi-ring-mb", str(int(host / 2) - 1)]).dmi_ring_mb == int(host / 2) - 1


def test_ring_limit_is_shared_by_the_processes_of_the_machine(monkeypatch):
    host = _host_mib()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    msg = _parse_error(["--dmi-ring-mb", str(int(host / 4))])  # fits one process, not four
    assert "of each of its 4 process(es)" in msg and f"use at most {host / 8:.0f}" in msg, msg


@pytest.mark.parametrize("mb", ["inf", "nan", "-inf", "0"])
def test_ring_sizes_that_are_not_finite_positive_are_refused(mb):
    assert "error: argument --dmi-ring-mb: ring size must hold at least one" in _parse_error([f"--dmi-ring-mb={mb}"])


@pytest.mark.parametrize(
    "flag,value,expect",
    [
        ("--dmi-clickhouse-database", "system", "is reserved by ClickHouse"),
        ("--dmi-run-id", "..", "run id must be"),
        ("--dmi-ring-mb", "1e6", "does not fit this machine"),
    ],
)
def test_harmful_values_stop_a_real_run_before_the_model_is_built(flag, value, expect, tmp_path):
    if flag == "--dmi-ring-mb" and 2e6 <= _host_mib():
        pytest.skip("this machine has room for a 1e6 MiB ring")
    store = str(tmp_path / "store")
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "pretrain_gpt.py"),
            *tiny_moe_args(),
            "--cpu-dev-mode",
            "--dmi-hooks",
            "router",
            "--dmi-store-dir",
            store,
            flag,
            value,
        ],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    err = [ln for ln in p.stderr.splitlines() if f"error: argument {flag}:" in ln]
    assert err and expect in err[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout and not os.path.exists(store)
