"""pip users can train without the repository checkout: the installed ``megatron-dmi-pretrain-gpt``
console script (and ``python -m megatron.training.dmi.pretrain_gpt``) run from anywhere, and a built
wheel carries the training entry and both console scripts."""

import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile

from tests.functional_tests.launch import REPO, tiny_moe_args

SCRIPT = os.path.join(os.path.dirname(sys.executable), "megatron-dmi-pretrain-gpt")
LAYERS, MICROBATCHES, ITERS, ROUTER_OUTPUTS = 2, 2, 4, 4


def test_console_script_trains_from_a_directory_outside_the_checkout(tmp_path):
    assert os.access(SCRIPT, os.X_OK), "pip install -e . creates the console script"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        [
            SCRIPT,
            *tiny_moe_args(),
            "--cpu-dev-mode",
            "--dmi-hooks",
            "router",
            "--dmi-persist",
            "spool",
            "--dmi-store-dir",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    captured = re.search(r"rank 0: captured (\d+) records", out)
    assert captured and int(captured.group(1)) == LAYERS * MICROBATCHES * ITERS * ROUTER_OUTPUTS, out[-3000:]
    assert "dropped 0" in out
    assert any(f.endswith(".dmiraw") or f.endswith(".parquet") for _, _, fs in os.walk(tmp_path / "store") for f in fs)


def test_module_entry_answers_help_from_anywhere(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "megatron.training.dmi.pretrain_gpt", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--dmi-hooks" in p.stdout and "--cpu-dev-mode" in p.stdout


def test_wheel_ships_the_training_entry_and_its_console_script(tmp_path):
    # a copy of the sources, so that the build's own folders never land in the checkout
    source = tmp_path / "source"
    shutil.copytree(
        REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "dmi_store")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=600,
        cwd=tmp_path,
    )
    (wheel,) = os.listdir(tmp_path / "dist")
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as z:
        names = z.namelist()
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode())
    assert "megatron/training/dmi/pretrain_gpt.py" in names and "megatron_dmi/__init__.py" in names
    assert dict(entry_points["console_scripts"]) == {
        "megatron-dmi": "megatron_dmi:main",
        "megatron-dmi-pretrain-gpt": "megatron.training.dmi.pretrain_gpt:main",
    }
