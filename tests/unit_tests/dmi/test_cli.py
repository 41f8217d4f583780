"""``python -m megatron.core.dmi`` against a real embedded store."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.core.dmi import cli
from megatron.core.dmi.sinks.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_store")
    recs = W.moe_records(iterations=range(1, 4), layers=(0, 1), experts=4, tp=2, sp=True, seed=11)
    run_isolated(W.write_embedded, str(d), recs, [W.run_info()], drops=[recs[0].key])
    return str(d), recs


def test_show(store):
    d, recs = store
    rc, out = run_isolated(W.load_cli, ["show", d])
    assert rc == 0, out
    assert f"run {W.RUN}: {len(recs)} records" in out
    assert "router.logits" in out and "router.expert_counts" in out
    assert "expert load (tokens after capacity dropping) at iteration 3:" in out
    lines = out.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("expert load"))
    header = lines[i + 1].split()
    assert header[:5] == ["layer", "e0", "e1", "e2", "e3"]
    counts = [r for r in recs if r.key.output == "router.expert_counts" and r.key.iteration == 3 and r.key.layer == 1]
    post = sum(r.tensor()[1].long() for r in counts).tolist()
    row = next(line.split() for line in lines[i + 2:] if line.split()[0] == "1")
    assert [int(x) for x in row[1:5]] == post
    assert "records dropped before persistence: 1" in out


def test_show_entry_point_subprocess(store):
    d, _ = store
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "megatron.core.dmi", "show", d, "--iteration", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "expert load (tokens after capacity dropping) at iteration 2:" in p.stdout


def test_other_commands(store, tmp_path):
    d, recs = store
    rc, out = run_isolated(W.load_cli, ["runs", d])
    assert rc == 0 and W.RUN in out
    rc, out = run_isolated(W.load_cli, ["describe", d, "--config"])
    assert rc == 0 and '"note": "test"' in out
    pt = str(tmp_path / "t.pt")
    rc, out = run_isolated(W.load_cli, ["tensor", d, "--output", "router.logits", "--iteration", "2", "--layer", "1", "--save", pt])
    assert rc == 0 and "shape [8, 4] dtype float32" in out and "mean" in out
    ref = torch.cat([r.tensor() for r in recs if r.key.output == "router.logits" and r.key.iteration == 2 and r.key.layer == 1])
    assert torch.equal(torch.load(pt), ref)
    rc, out = run_isolated(W.load_cli, ["expert-load", d])
    assert rc == 0 and "dropped" in out and len(out.splitlines()) == 1 + 3 * 2
    rc, out = run_isolated(W.load_cli, ["drops", d])
    assert rc == 0 and "records dropped before persistence in run run-a: 1" in out and "ring full" in out
    assert "drop_rate" in out


def test_errors_are_one_line(store, tmp_path):
    d, _ = store
    rc, out = run_isolated(W.load_cli, ["tensor", d, "--run", "nope", "--output", "router.logits", "--iteration", "1"])
    assert rc == 2
    rc, out = run_isolated(W.load_cli, ["load", str(tmp_path / "missing"), "--store", str(tmp_path / "s")])
    assert rc == 2


def test_subcommand_registry():
    seen = []

    def setup(p):
        p.add_argument("--x", type=int)
        p.set_defaults(func=lambda a: seen.append(a.x) or 0)

    cli.add_subcommand("test-extra", setup, "a command added by another module")
    try:
        assert cli.main(["test-extra", "--x", "5"]) == 0 and seen == [5]
    finally:
        cli._COMMANDS.pop("test-extra")
    for name in ("show", "runs", "describe", "tensor", "expert-load", "drops", "load", "export"):
        assert name in cli._COMMANDS
