"""DMI's start-up checks that need Megatron's validated config answer as argparse does, before
Megatron's ~750-line argument dump: the one-line usage, ``<prog>: error: argument --dmi-...: <why>``
naming the wrong value and the way out, exit 2."""

import os
import subprocess
import sys

import pytest

from tests.functional_tests.launch import REPO, tiny_moe_args

DUMP = "------------------------ arguments ------------------------"
CASES = {
    "layers beyond the model": (
        ["--dmi-layers", "99"],
        "--dmi-layers: layer(s) 99 not in this model: --num-layers 2 has layers 0-1",
    ),
    "unreachable server": (
        ["--dmi-clickhouse-url", "http://127.0.0.1:1"],
        "--dmi-clickhouse-url: ClickHouse at http://127.0.0.1:1 is unreachable",
    ),
    "store folder that is a file": (
        ["--dmi-store-dir", "{tmp}/a_file"],
        "--dmi-store-dir: '{tmp}/a_file' is a file; name a folder (created if missing)",
    ),
}


def _refused(p: subprocess.CompletedProcess, prog: str, error: str) -> None:
    assert p.returncode == 2, (p.stdout + p.stderr)[-3000:]
    lines = p.stderr.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(f"{prog}: error: argument ")]
    assert error in lines[at], lines[at]
    assert lines[at - 1].startswith(f"usage: {prog} [Megatron arguments]") and len(lines[at - 1]) < 160
    assert DUMP not in p.stdout, "the refusal must come before Megatron's argument dump"
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_the_argument_dump_with_usage_and_exit_2(case, tmp_path):
    flags, error = CASES[case]
    (tmp_path / "a_file").write_text("")
    flags = [f.format(tmp=tmp_path) for f in flags]
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *tiny_moe_args(), "--cpu-dev-mode"]
        + ["--dmi-hooks", "router", *flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    _refused(p, "pretrain_gpt.py", error.format(tmp=tmp_path))


def test_the_launcher_refuses_the_same_way_naming_the_users_script(tmp_path):
    own_entry = os.path.join(os.path.dirname(os.path.abspath(__file__)), "own_entry.py")
    p = subprocess.run(
        [sys.executable, "-m", "megatron.training.dmi.launch", own_entry, *tiny_moe_args(), "--cpu-dev-mode"]
        + ["--dmi-hooks", "router", "--dmi-layers", "99"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    _refused(p, "own_entry.py", CASES["layers beyond the model"][1])
