"""Run identity across a crash at every point around a checkpoint save (issue 17 item 3).

A real pretrain_gpt.py (tiny MoE, CPU mode, torch checkpoints every 2 iterations) is SIGKILLed at
one point (tests/fault_tests/crash_launch.py), then resumed with --load from its latest
checkpoint. The store, read back in its own process, must hold ONE run in which every iteration is
visible exactly once, whatever the crash point.
"""

import os
import subprocess
import sys

import pytest

from tests.fault_tests.test_faults import PER_ITER, TORCH_CKPT, only_run, read_store, report_line
from tests.functional_tests.launch import tiny_moe_args

HERE = os.path.dirname(os.path.abspath(__file__))


def train(tmp, args, point="", at=4):
    env = dict(os.environ, PYTHONUNBUFFERED="1", DMI_CRASH=point, DMI_CRASH_ITER=str(at))
    cmd = [sys.executable, os.path.join(HERE, "crash_launch.py"), *tiny_moe_args(), "--cpu-dev-mode", *args]
    p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    with open(os.path.join(tmp, f"train-{point or 'resume'}.log"), "a") as f:
        f.write(" ".join(cmd) + "\n" + out)
    return p.returncode, out


def latest_checkpoint(ckpt):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read().strip())


# point -> (iterations of the first run, latest checkpoint after the kill, iterations of the resume)
CRASH_POINTS = {
    "before_save": (6, 2, 6),
    "after_megatron_save": (6, 4, 6),
    "after_save": (6, 4, 6),
    "during_close": (6, 6, 8),
}


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_kill_around_a_checkpoint_then_resume_is_one_run_with_every_iteration_once(point, tmp_path):
    first_iters, latest, resume_iters = CRASH_POINTS[point]
    tmp = str(tmp_path)
    store, ckpt = os.path.join(tmp, "store"), os.path.join(tmp, "ckpt")
    common = ["--dmi-hooks", "router", "--dmi-store-dir", store, "--save", ckpt, "--save-interval", "2", *TORCH_CKPT]
    rc, out = train(tmp, common + ["--train-iters", str(first_iters)], point=point, at=4)
    assert rc == -9, out[-3000:]
    assert f"CRASH {point}" in out and "DMI end-of-run report" not in out, out[-3000:]
    assert latest_checkpoint(ckpt) == latest
    run_id = out.split("DMI: run ", 1)[1].split()[0]

    # the scheduler follows the new --train-iters (a resume after a finished run trains further)
    rc, out2 = train(
        tmp, common + ["--train-iters", str(resume_iters), "--load", ckpt, "--override-opt-param-scheduler"]
    )
    assert rc == 0, out2[-4000:]
    assert f"DMI: run {run_id} attempt 2" in out2, out2[-3000:]  # the same run, its second attempt
    line = report_line(out2)
    assert f"captured {(resume_iters - latest) * PER_ITER} records" in line and "dropped 0" in line, line
    run = only_run(read_store(store)[0])
    assert run["visible_per_iteration"] == {str(i): PER_ITER for i in range(1, resume_iters + 1)}
    assert run["duplicate_visible_keys"] == 0
    assert run["rebuilt"] == resume_iters * PER_ITER
