"""What a new user runs into with the reading commands (issue 32): a wrong folder, a partial iteration shown as
whole, counts after a resume, unknown names, an unreachable server, a store that does not exist yet.

Every command runs as the user runs it: ``megatron-dmi`` in a process of its own, its exit status and both of its
output streams checked (no traceback may reach the user).
"""

import os
import subprocess
import sys

import pytest

from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def megatron_dmi(*argv: str) -> subprocess.CompletedProcess:
    """``megatron-dmi ARGV`` as a user runs it."""
    p = subprocess.run(
        [sys.executable, "-m", "megatron_dmi", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """A folder holding one store, ``<parent>/quickstart`` (as ``dmi_store`` holds the quickstart's)."""
    d = tmp_path_factory.mktemp("dmi_store")
    recs = W.moe_records(iterations=range(1, 4), layers=(0, 1), experts=4, seed=3)
    run_isolated(W.write_embedded, str(d / "quickstart"), recs, [W.run_info()])
    return d


# -- 1. a wrong folder ------------------------------------------------------------------------------------------


def test_a_parent_of_stores_names_them_and_fails(parent):
    p = megatron_dmi("show", str(parent))
    assert p.returncode == 2, p.stdout
    assert "is not a DMI store" in p.stderr and "quickstart" in p.stderr, p.stderr
    assert not os.path.exists(parent / ".readers"), "a reader left something in a folder that is no store"


def test_a_save_folder_names_the_store_two_levels_down(parent, tmp_path):
    os.symlink(parent, tmp_path / "dmi_store")  # <--save>/dmi_store/quickstart
    p = megatron_dmi("show", str(tmp_path))
    assert p.returncode == 2 and os.path.join("dmi_store", "quickstart") in p.stderr, p.stderr


def test_a_folder_with_no_store_under_it_says_which_folder_to_pass(tmp_path):
    p = megatron_dmi("runs", str(tmp_path))
    assert p.returncode == 2 and "--dmi-store-dir" in p.stderr, p.stderr
    assert os.listdir(tmp_path) == []


def test_a_plain_file_is_named_as_a_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    p = megatron_dmi("show", str(f))
    assert p.returncode == 2 and "is a file, not a DMI store" in p.stderr, p.stderr


def test_plot_example_on_a_parent_folder_prints_the_message(parent, tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "plot_dmi.py"), str(parent), "--out", str(tmp_path / "png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr  # no upstream import notices
    assert "is not a DMI store" in p.stderr and "quickstart" in p.stderr, p.stderr


# -- 3. show's expert load is a complete iteration --------------------------------------------------------------


def test_show_skips_a_partial_newest_iteration_and_says_so(tmp_path):
    recs = W.moe_records(iterations=range(1, 4), layers=(0, 1), experts=4, seed=5)
    partial = [r for r in W.moe_records(iterations=[4], layers=(0, 1), experts=4, seed=6) if r.key.layer == 0]
    run_isolated(W.write_embedded, str(tmp_path / "s"), recs + partial, [W.run_info()])
    p = megatron_dmi("show", str(tmp_path / "s"))
    assert p.returncode == 0, p.stderr
    assert "expert load (tokens after capacity dropping) at iteration 3:" in p.stdout, p.stdout
    assert "the latest complete iteration" in p.stdout and "4 (2 of 4 parts)" in p.stdout, p.stdout
    p = megatron_dmi("show", str(tmp_path / "s"), "--iteration", "4")
    assert p.returncode == 0 and "iteration 4 is partial: 2 of 4" in p.stdout, p.stdout


# -- 4. counts after a resume -----------------------------------------------------------------------------------


def _resumed_counts(store_dir: str) -> dict:
    from megatron.core.dmi.reader import open_store

    with open_store(store_dir) as store:
        d = store.describe(None)
        runs = store.runs()
        view = store.df(f"SELECT iteration, attempt, count() AS n FROM {store.t('tensors_latest')} GROUP BY ALL")
        counts = store.df(f"SELECT count() AS n FROM {store.t('expert_counts_latest')}")["n"][0]
        return {
            "describe": d.records,
            "superseded": d.superseded_records,
            "runs": int(runs["records"][0]),
            "runs_superseded": int(runs["superseded"][0]),
            "view": int(view["n"].sum()),
            "view_attempts": {int(i): int(a) for i, a in zip(view["iteration"], view["attempt"])},
            "visible": {i: a for (_, i), a in store.visible_attempts(d.run_id).items()},
            "expert_counts_rows": int(counts),
            "expert_load_rows": int(store.expert_load(d.run_id)["tokens_pre"].count()),
        }


def test_runs_show_and_the_sql_view_agree_after_a_resume(tmp_path):
    d = str(tmp_path / "s")
    a1 = W.moe_records(iterations=range(1, 6), attempt=1, seed=0, sp=False)
    a2 = W.moe_records(iterations=range(4, 8), attempt=2, seed=1, sp=False)
    run_isolated(W.write_embedded, d, a1, [W.run_info(attempt=1)])
    run_isolated(W.write_embedded, d, a2, [W.run_info(attempt=2, resumed_from=3)])
    run_isolated(W.write_embedded, d, [], [W.run_info(attempt=3, resumed_from=6)])  # died before writing
    c = run_isolated(_resumed_counts, d)
    assert c["view_attempts"] == c["visible"] == {1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2}
    assert c["view"] == c["describe"] == c["runs"]
    assert c["runs_superseded"] == c["superseded"] == len(a1) + len(a2) - c["describe"] > 0
    # replicated producers: the view keeps every rank's row, expert_load counts each (token range, expert) once
    assert c["expert_counts_rows"] == 2 * c["expert_load_rows"]
    p = megatron_dmi("runs", d)
    assert p.returncode == 0 and "superseded" in p.stdout, p.stdout


# -- 8. messages that name the wrong thing ---------------------------------------------------------------------


def test_expert_load_at_an_uncaptured_layer_names_the_captured_ones(parent):
    store = str(parent / "quickstart")
    p = megatron_dmi("expert-load", store, "--layer", "9")
    assert p.returncode == 2 and "no router.expert_counts at layer(s) 9" in p.stderr, p.stderr
    assert "captured at layer(s) 0-1" in p.stderr
    p = megatron_dmi("expert-load", store, "--iteration", "2", "--layer", "9")
    assert p.returncode == 2 and "layer(s) 9, iteration 2" in p.stderr, p.stderr


def test_tensor_with_a_misspelled_output_names_it_and_the_captured_ones(parent):
    store = str(parent / "quickstart")
    p = megatron_dmi("tensor", store, "--output", "router.logit", "--iteration", "2", "--layer", "1")
    assert p.returncode == 2, p.stdout
    assert "unknown output 'router.logit'" in p.stderr and "router.expert_counts, router.logits" in p.stderr
    assert "did you mean 'router.logits'?" in p.stderr, p.stderr
    p = megatron_dmi("tensor", store, "--output", "router.topk_ids", "--iteration", "2")
    assert p.returncode == 2 and "output 'router.topk_ids': run" in p.stderr, p.stderr
    p = megatron_dmi("tensor", store, "--output", "router.logits", "--iteration", "2", "--layer", "5")
    assert p.returncode == 2 and "captured at layer(s) 0-1, not at layer 5" in p.stderr, p.stderr


def test_an_unreachable_server_is_one_line():
    p = megatron_dmi("show", "http://127.0.0.1:1")
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "Connection refused" in p.stderr, p.stderr
    assert "Unexpected Http Driver Exception" not in p.stderr


def test_watch_waits_for_a_store_the_run_has_not_created_yet(tmp_path):
    p = megatron_dmi("watch", str(tmp_path / "not_yet"), "--once")
    assert p.returncode == 0 and "waiting for the run to create it" in p.stdout, p.stdout + p.stderr
    p = megatron_dmi("watch", str(tmp_path / "not_yet"), "--once", "--json")
    assert p.returncode == 0 and '"store_missing": true' in p.stdout


def test_a_misspelled_hook_gets_the_nearest_name():
    from megatron.core.dmi.catalog import HookSelectionError, parse_hooks

    with pytest.raises(HookSelectionError, match=r"unknown hook 'routr': did you mean 'router'\? \(known: all, none"):
        parse_hooks("routr,attn")
    with pytest.raises(HookSelectionError, match=r"unknown hook 'bogus' \(known: "):
        parse_hooks("bogus")


def test_doctor_suggests_no_cuda_build_without_a_gpu():
    import torch

    from megatron.core.dmi.cli import doctor

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    checks = doctor.check_build_tools(require_cuda=False)
    assert not [c for c in checks if c.name == "jit cache (cuda)" or "--build cuda" in (c.fix or "")], checks


def _kill_attempt_one(store_dir: str) -> None:
    """Attempt 1 killed: its records and run row are in, its ranks' end-of-run reports never came."""
    from megatron.core.dmi.store.backend import ChdbBackend

    W.write_embedded(store_dir, W.moe_records(iterations=range(1, 4), attempt=1), [W.run_info(attempt=1)])
    b = ChdbBackend(os.path.join(store_dir, "chdb"))
    try:
        b.command("TRUNCATE TABLE dmi.reports")
    finally:
        b.close()
    W.write_embedded(
        store_dir, W.moe_records(iterations=range(3, 5), attempt=2), [W.run_info(attempt=2, resumed_from=2)]
    )


def test_show_says_which_attempt_died(tmp_path):
    d = str(tmp_path / "s")
    run_isolated(_kill_attempt_one, d)
    for command in ("show", "describe"):
        p = megatron_dmi(command, d)
        assert p.returncode == 0, p.stderr
        lines = [line for line in p.stdout.splitlines() if line.strip().startswith("attempt ")]
        assert "died before it ended (no end-of-run report)" in lines[0], p.stdout
        assert "died" not in lines[1] and "report" not in lines[1], p.stdout


def test_load_names_a_killed_writers_unfinished_segment(tmp_path):
    spool = tmp_path / "spool" / "rank-00000"
    spool.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = spool / f".00000003.dmiraw.{dead.pid}.tmp"
    leftover.write_bytes(b"DMIRAW half a segment")
    p = megatron_dmi("load", str(tmp_path / "spool"), "--store", str(tmp_path / "store"))
    assert p.returncode == 0, p.stderr
    assert f"skipped {leftover}: a segment its process was killed while writing" in p.stdout, p.stdout
    assert leftover.exists()
    p = megatron_dmi("load", str(tmp_path / "spool"), "--store", str(tmp_path / "store"), "--delete")
    assert p.returncode == 0 and f"deleted {leftover}" in p.stdout, p.stdout
    assert not leftover.exists()


# -- 7. only what matters on stderr -----------------------------------------------------------------------------


def test_python_readers_through_megatron_dmi_print_no_upstream_notices(parent):
    code = (
        "import sys, megatron_dmi\n"
        "with megatron_dmi.open_store(sys.argv[1]) as s:\n"
        "    run = s.resolve_run(None)\n"
        "    t = s.tensor(run, 'router.logits', iteration=2, layer=1)\n"
        "    print(len(s.df('SELECT * FROM dmi.tensors_latest')), list(t.shape))\n"
        "print('megatron.core.parallel_state' in sys.modules)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(parent / "quickstart")], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.split() == ["24", "[8,", "4]", "False"], p.stdout


def test_doctor_prints_no_torch_cuda_notice():
    p = megatron_dmi("doctor")
    assert "No CUDA runtime is found" not in p.stderr and "UserWarning" not in p.stderr, p.stderr


def _store_without_views(store_dir: str) -> None:
    """A schema-version-2 store written before the ``*_latest`` views existed."""
    from megatron.core.dmi.store.backend import ChdbBackend

    W.write_embedded(store_dir, W.moe_records(iterations=range(1, 3)), [W.run_info()])
    b = ChdbBackend(os.path.join(store_dir, "chdb"))
    try:
        b.command("DROP VIEW dmi.tensors_latest")
        b.command("DROP VIEW dmi.expert_counts_latest")
    finally:
        b.close()


def test_a_store_from_before_the_views_still_opens(tmp_path):
    d = str(tmp_path / "s")
    run_isolated(_store_without_views, d)
    p = megatron_dmi("runs", d)
    assert p.returncode == 0 and W.RUN in p.stdout, p.stderr


def test_custom_loop_example_prints_no_upstream_notices(tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "custom_loop.py"), "--iterations", "2", "--microbatches", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for noise in ("Warning", "No CUDA runtime", "deprecated", "Traceback"):
        assert noise not in p.stderr, p.stderr
    assert "router.topk_ids at iteration 2, layer 1" in p.stdout
