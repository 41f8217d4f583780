"""``python -m megatron.core.dmi`` against a real embedded store."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.core.dmi import cli
from tests.unit_tests.dmi.isolated import run_isolated
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
    row = next(line.split() for line in lines[i + 2 :] if line.split()[0] == "1")
    assert [int(x) for x in row[1:5]] == post
    assert "records dropped before persistence: 1" in out


def test_show_entry_point_subprocess(store):
    d, _ = store
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", "show", d, "--iteration", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "expert load (tokens after capacity dropping) at iteration 2:" in p.stdout


def test_other_commands(store, tmp_path):
    d, recs = store
    rc, out = run_isolated(W.load_cli, ["runs", d])
    assert rc == 0 and W.RUN in out
    rc, out = run_isolated(W.load_cli, ["describe", d, "--config"])
    assert rc == 0 and '"note": "test"' in out
    pt = str(tmp_path / "t.pt")
    rc, out = run_isolated(
        W.load_cli, ["tensor", d, "--output", "router.logits", "--iteration", "2", "--layer", "1", "--save", pt]
    )
    assert rc == 0 and "shape [8, 4] dtype float32" in out and "mean" in out
    ref = torch.cat(
        [r.tensor() for r in recs if r.key.output == "router.logits" and r.key.iteration == 2 and r.key.layer == 1]
    )
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
        cli.COMMANDS.pop("test-extra")
    for name in ("show", "runs", "describe", "tensor", "expert-load", "drops", "load", "export"):
        assert name in cli.COMMANDS


# -- the newcomer's bug list (issue 20) ---------------------------------------------------------


def test_expert_load_iteration_honours_layer(store):
    d, _ = store
    rc, out = run_isolated(W.load_cli, ["expert-load", d, "--iteration", "2", "--layer", "1"])
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1"], out


def test_tensor_error_names_the_cli_flag(store):
    d, _ = store
    rc, err = run_isolated(W.cli_stderr, ["tensor", d, "--output", "router.logits", "--iteration", "2"])
    assert rc == 2
    assert "pass --layer" in err and "layer=" not in err, err


def _write_two_runs(d: str) -> None:
    from megatron.core.dmi.sinks.meta import RunInfo

    W.write_embedded(d, W.moe_records(run_id="run-old"), [W.run_info(run_id="run-old")])
    info = RunInfo("run-new", 1, None, {"run_id": None, "hooks": ["router"]}, layers=[0, 1])
    W.write_embedded(d, W.moe_records(run_id="run-new", iterations=range(1, 3)), [info])


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("two_runs"))
    run_isolated(_write_two_runs, d)
    return d


def test_show_prints_the_latest_run_as_its_help_says(two_runs):
    rc, out = run_isolated(W.load_cli, ["show", two_runs])
    assert rc == 0 and "run run-new:" in out and "run run-old:" not in out, out
    assert "--all shows every run" in out
    rc, out = run_isolated(W.load_cli, ["show", two_runs, "--all"])
    assert rc == 0 and "run run-new:" in out and "run run-old:" in out
    rc, out = run_isolated(W.load_cli, ["show", two_runs, "--run", "run-old"])
    assert rc == 0 and "run run-old:" in out and "run run-new:" not in out
    assert "default: the latest run" in cli.build_parser()._subparsers._group_actions[0].choices["show"].format_help()


def test_describe_config_shows_the_generated_run_id(two_runs):
    rc, out = run_isolated(W.load_cli, ["describe", two_runs, "--config"])
    assert rc == 0 and '"run_id": "run-new"' in out and '"run_id": null' not in out, out


def _write_with_lost_counts(d: str) -> list:
    recs = W.moe_records(iterations=range(1, 4))
    lost = [
        r for r in recs if r.key.output == "router.expert_counts" and r.key.iteration == 2 and r.key.coords.rank == 1
    ]
    kept = [r for r in recs if r not in lost]
    W.write_embedded(d, kept, [W.run_info()], drops=[r.key for r in lost])
    return [r.key.iteration for r in lost]


def test_drops_marks_iterations_with_lost_expert_counts(tmp_path):
    d = str(tmp_path / "s")
    run_isolated(_write_with_lost_counts, d)
    rc, out = run_isolated(W.load_cli, ["drops", d])
    assert rc == 0, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows["2"].rstrip().endswith("*") and not rows["1"].rstrip().endswith("*"), out
    assert "* partial: 1 iteration(s)" in out


# -- a fast, quiet CLI ----------------------------------------------------------------------------


def imports_of_command(argv: list[str]) -> tuple[str, str]:
    """Run ``megatron-dmi argv`` in a fresh process; (its stdout ending with 'LOADED <torch imported>
    <megatron-core imported> <exit status>', its stderr)."""
    code = (
        "import sys, megatron_dmi; rc = megatron_dmi.main(sys.argv[1:]);"
        "print('LOADED', 'torch' in sys.modules, 'megatron.core.parallel_state' in sys.modules, rc)"
    )
    p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout, p.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["show"],
        ["tensor", "--output", "router.logits", "--iteration", "2", "--layer", "1"],
        ["tensor", "--output", "router.expert_counts", "--iteration", "2", "--layer", "0"],
        ["watch", "--once"],
        ["routing-concentration"],
    ],
    ids=lambda argv: argv[0] + ("-" + argv[2] if len(argv) > 2 else ""),
)
def test_megatron_dmi_entry_imports_neither_torch_nor_megatron_core(store, argv):
    """Reading commands decode payloads with numpy: neither torch (about 1.6 s) nor megatron-core is imported."""
    d, _ = store
    out, err = imports_of_command([argv[0], d, *argv[1:]])
    assert out.rstrip().endswith("LOADED False False 0"), out
    assert err == "", "no upstream warnings"
    if argv[0] == "tensor":
        assert "shape [8, 4] dtype float32" in out or "shape [2, 4] dtype int32" in out, out
    if argv[0] == "watch":
        assert "entropy" in out, out


def test_cli_output_has_no_upstream_warnings(store):
    d, _ = store
    p = subprocess.run(
        [sys.executable, "-m", "megatron_dmi", "watch", d, "--once"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "iteration 3: tokens per expert" in p.stdout
    assert p.stderr == ""
