"""``pretrain_gpt.py --help`` works on any machine and lists DMI's flags beside upstream's."""

import argparse
import os
import subprocess
import sys

import pytest

from megatron.training.dmi.arguments import add_dmi_args
from megatron.training.dmi.entry import CPU_DEV_FLAG
from tests.functional_tests.launch import REPO


@pytest.mark.parametrize("device_flags", [[], [CPU_DEV_FLAG]], ids=["plain", "cpu-dev-mode"])
def test_help_lists_upstream_and_dmi_flags_and_exits_0(device_flags, tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--help", *device_flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    listed = {word.rstrip(",") for line in p.stdout.splitlines() for word in line.split() if word.startswith("--")}
    dmi_flags = {
        o for a in add_dmi_args(argparse.ArgumentParser())._actions for o in a.option_strings if o.startswith("--dmi-")
    }
    assert dmi_flags and dmi_flags <= listed, sorted(dmi_flags - listed)
    assert {CPU_DEV_FLAG, "--num-layers", "--tensorboard-dir"} <= listed
    assert "no CUDA GPU" not in p.stdout + p.stderr
