"""``python -m megatron.core.dmi doctor``: real probes on this machine, plus forced failures (no
compiler on PATH, an unreachable server, a wrong package version, a world-readable store)."""

import os
import subprocess
import sys

import pytest

from megatron.core.dmi import catalog
from megatron.core.dmi.cli import doctor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _doctor(*args, env=None, timeout=300):
    e = dict(os.environ, PYTHONWARNINGS="ignore")
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", "doctor", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=e,
        timeout=timeout,
    )


def _lines(out: str) -> dict[str, str]:
    """check name -> status, from the doctor's output lines."""
    res = {}
    for line in out.splitlines():
        parts = line.split(None, 1)
        if parts and parts[0] in doctor.STATUSES:
            res[line[6:28].strip()] = parts[0]
    return res


@pytest.fixture(scope="module")
def unreachable_run():
    """One full doctor run against a server URL nobody listens on, with a password in the env."""
    return _doctor("--clickhouse-url", "http://127.0.0.1:1", env={"DMI_CLICKHOUSE_PASSWORD": "s3cret-Pw!d0ct0r"})


def test_every_line_is_ok_warn_or_fail_with_a_summary(unreachable_run):
    out = unreachable_run.stdout
    body = [ln for ln in out.splitlines() if ln.strip()]
    assert body[-1].startswith("doctor: ")
    for ln in body[:-1]:
        assert ln.split()[0] in doctor.STATUSES, ln
        if ln.split()[0] != "ok":
            assert "-> fix: " in ln, ln
    checks = _lines(out)
    for name in (
        "python",
        "torch",
        "megatron-core",
        "dataset helpers",
        "cuda",
        "c++ compiler",
        "ninja",
        "chdb",
        "chdb round trip",
        "transformer engine",
        "apex",
        "clickhouse server",
    ):
        assert name in checks, (name, out)
    assert checks["python"] == checks["torch"] == checks["megatron-core"] == checks["dataset helpers"] == "ok"
    assert checks["chdb round trip"] == "ok", out


def test_unreachable_server_fails_with_exit_code_1_and_no_password(unreachable_run):
    p = unreachable_run
    assert p.returncode == 1, p.stdout + p.stderr
    assert _lines(p.stdout)["clickhouse server"] == "fail"
    assert "127.0.0.1:1" in p.stdout and "--dmi-persist spool" in p.stdout
    assert "s3cret-Pw!d0ct0r" not in p.stdout + p.stderr


def test_missing_compiler_on_path_fails(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    p = _doctor(env={"PATH": str(empty), "CXX": "no-such-compiler"})
    checks = _lines(p.stdout)
    assert checks["c++ compiler"] == "fail", p.stdout
    assert "--dmi-transport torch" in p.stdout
    assert p.returncode == 1


def test_check_cuda_fails_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    assert doctor.check_cuda(require=True)[0].status == "fail"
    assert doctor.check_cuda(require=False)[0].status == "warn"


def test_wrong_megatron_core_version_fails(monkeypatch):
    real = doctor.metadata.version
    monkeypatch.setattr(doctor.metadata, "version", lambda d: "0.16.0" if d == "megatron-core" else real(d))
    c = doctor.check_megatron_core()[0]
    assert c.status == "fail" and "0.17.1" in c.fix


def test_build_host_ring():
    checks = doctor.check_jit_build("host")
    assert [c.status for c in checks] == ["ok"], [c.line() for c in checks]


def test_store_checks(tmp_path):
    good = tmp_path / "store"
    good.mkdir(mode=0o700)
    os.chmod(good, 0o700)
    assert [c.status for c in doctor.check_store(str(good), "dmi")][0] == "ok"
    os.chmod(good, 0o755)
    first = doctor.check_store(str(good), "dmi")[0]
    assert first.status == "warn" and "chmod 700" in first.fix
    missing = doctor.check_store(str(tmp_path / "nope" / "deeper"), "dmi")
    assert missing[0].status == "fail"
    f = tmp_path / "file"
    f.write_text("x")
    assert doctor.check_store(str(f), "dmi")[0].status == "fail"


def test_hostile_database_name_is_a_failure_not_a_query():
    c = doctor.check_server("http://127.0.0.1:1", "dmi; DROP TABLE x", None)
    assert [x.status for x in c] == ["fail"] and "database name" in c[0].detail


def test_hooks_markdown_command_prints_the_catalog_table():
    p = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", "hooks", "--markdown"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 0
    assert p.stdout.strip() == catalog.markdown_table().strip()
