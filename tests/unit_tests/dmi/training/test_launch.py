"""DMI inside a user's own entry script: ``python -m megatron.training.dmi.launch own_entry.py ...``
runs the script unchanged (own_entry.py: its own providers, forward step and flag, calling
``megatron.training.pretrain``). With ``--dmi-hooks`` every record lands in the store, DMI's state
sits beside the checkpoint and its end-of-run report is printed; without a ``--dmi-*`` flag nothing
of DMI is installed."""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron.core.dmi.reader import open_store
from tests.functional_tests.launch import tiny_moe_args

OWN_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "own_entry.py")
LAYERS, MICROBATCHES, ITERS = 2, 2, 4
ROUTER_OUTPUTS = ("router.expert_counts", "router.logits", "router.topk_ids", "router.topk_probs")


def _launch(args: list[str], cwd, launcher: bool = True) -> subprocess.CompletedProcess:
    head = [sys.executable, "-m", "megatron.training.dmi.launch"] if launcher else [sys.executable]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([*head, OWN_ENTRY, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _reported(out: str, when: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(f"own entry {when} pretrain:")]
    return line


def _modules(line: str) -> list[str]:
    return eval(line.split("dmi_modules=")[1])  # the script prints a list of module names


@pytest.fixture(scope="module")
def with_dmi(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    args = tiny_moe_args() + ["--cpu-dev-mode", "--greeting", "hi", "--save", str(tmp / "ckpt"), "--save-interval", "4"]
    args += ["--dmi-hooks", "router", "--dmi-persist", "clickhouse", "--dmi-store-dir", str(tmp / "store")]
    p = _launch(args, tmp)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return tmp, args, p.stdout + p.stderr


def test_the_script_runs_as_main_with_its_own_arguments_and_flag(with_dmi):
    _, args, out = with_dmi
    before = _reported(out, "before")
    assert before.startswith(f"own entry before pretrain: argv={args}"[:-1])  # CPU mode may append flags
    assert "greeting=hi pretrain_replaced=True" in _reported(out, "after")  # its provider chained with DMI's


def test_every_record_lands_in_the_store(with_dmi):
    tmp, _, out = with_dmi
    with open_store(str(tmp / "store")) as store:
        run = store.resolve_run(None)
        counts = store.df(f"SELECT output, count() AS n FROM dmi.tensors WHERE run_id = '{run}' GROUP BY output")
    assert dict(zip(counts["output"], counts["n"])) == dict.fromkeys(ROUTER_OUTPUTS, LAYERS * MICROBATCHES * ITERS)
    captured = LAYERS * MICROBATCHES * ITERS * len(ROUTER_OUTPUTS)
    assert re.search(rf"rank 0: captured {captured} records .* dropped 0", out), out[-3000:]  # end-of-run report
    with open(tmp / "ckpt" / f"dmi_state_iter_{ITERS:07d}.json", encoding="utf-8") as f:
        assert json.load(f)["run_id"] == run  # the run identity beside the checkpoint


def test_cpu_mode_without_dmi_flags_installs_no_dmi(tmp_path):
    p = _launch(tiny_moe_args() + ["--cpu-dev-mode", "--greeting", "hi"], tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    after = _reported(out, "after")
    assert "greeting=hi" in after
    assert "megatron.training.dmi.runtime" not in _modules(after) and "megatron.core.dmi.session" not in _modules(after)
    assert not (tmp_path / "dmi_store").exists()
    assert "DMI" not in out


def test_without_any_dmi_flag_the_script_runs_as_if_started_itself(tmp_path):
    """No GPU here, so the script stops where Megatron asks for CUDA: in the same way either way, and
    the launched one holds no DMI module (the launcher itself runs as ``__main__``)."""
    launched, direct = _launch(tiny_moe_args(), tmp_path), _launch(tiny_moe_args(), tmp_path, launcher=False)
    assert launched.returncode == direct.returncode
    assert _modules(_reported(launched.stdout, "before")) == _modules(_reported(direct.stdout, "before")) == []
    assert launched.stderr.strip().splitlines()[-1] == direct.stderr.strip().splitlines()[-1]


def test_a_missing_script_is_named(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "megatron.training.dmi.launch", "no_such_entry.py", "--dmi-hooks", "router"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2  # an argument error, as argparse's
    assert "no entry script at 'no_such_entry.py'" in p.stderr
