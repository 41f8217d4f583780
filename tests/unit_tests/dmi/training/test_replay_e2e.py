"""Routing replay end to end (CPU, real pretrain_gpt.py processes, real chDB): a run records its
routing, others replay it with --dmi-replay-routing and record their own."""

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.core.dmi.reader.routing_diff import expert_sets_of, routing_diff
from megatron.core.dmi.replay.request import ReplayRequest
from tests.functional_tests.launch import REPO, dump_store, run_pretrain, tiny_moe_args

# examples/tiny_moe_args.sh's model, by the names of the stored model summary
TINY_FACTS = {
    "num_layers": 2,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "seq_length": 32,
    "micro_batch_size": 2,
    "global_batch_size": 4,
}
HOOKS = ["--dmi-hooks", "router.topk_ids,loss.token", "--dmi-persist", "clickhouse"]


def _with(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def _train(tmp_path_factory, name: str, extra: list[str], seed: str = "1234") -> dict:
    tmp = str(tmp_path_factory.mktemp(name))
    store = os.path.join(tmp, "store")
    proc = run_pretrain(
        _with(tiny_moe_args(), "--seed", seed) + HOOKS + ["--dmi-store-dir", store] + extra, tmp, oracle=False
    )
    dump = dump_store(store, tmp)
    dump["log"] = proc.stdout + proc.stderr
    dump["store"] = store
    return dump


def _outputs(dump: dict, output: str) -> dict:
    return {k[:4]: v for k, v in dump["tensors"].items() if k[4] == output and k[0] == "train"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _train(tmp_path_factory, "source", [])


@pytest.fixture(scope="module")
def self_replay(tmp_path_factory, source):
    return _train(tmp_path_factory, "self", ["--dmi-replay-routing", source["store"]])


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory, source):
    replayed = _train(tmp_path_factory, "seed-replay", ["--dmi-replay-routing", source["store"]], seed="77")
    live = _train(tmp_path_factory, "seed-live", [], seed="77")
    return replayed, live


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_sets(a: dict, b: dict) -> bool:
    """Every token's expert set equal (router.topk_ids orders a token's slots by the run's own probabilities)."""
    return a.keys() == b.keys() and all(torch.equal(a[k].sort(1).values, b[k].sort(1).values) for k in a)


def test_self_replay_gives_the_source_ids_and_bitwise_losses(source, self_replay):
    ids = _outputs(source, "router.topk_ids")
    assert len(ids) == 2 * 2 * 4  # layers x microbatches x iterations
    assert _equal(_outputs(self_replay, "router.topk_ids"), ids)
    losses = _outputs(source, "loss.token")
    assert losses and _equal(_outputs(self_replay, "loss.token"), losses)


def test_another_seed_follows_the_stored_routing(source, other_seed):
    replayed, live = other_seed
    assert _same_sets(_outputs(replayed, "router.topk_ids"), _outputs(source, "router.topk_ids"))
    assert not _same_sets(_outputs(live, "router.topk_ids"), _outputs(source, "router.topk_ids"))
    assert not _equal(_outputs(replayed, "loss.token"), _outputs(live, "loss.token"))


def test_log_line_and_report_count_replayed_microbatches(self_replay):
    assert "routing replayed from run" in self_replay["log"]
    assert re.search(
        r"routing replayed from run \S+: 8 microbatches, 0 recomputed router forwards, fallbacks to live: 0",
        self_replay["log"],
    )


def _extract(tmp_path, source: dict, run: str | None, layers=(0, 1), **fact_changes):
    """The extraction subprocess as a training rank runs it: (status, last line of stderr)."""
    facts = {**TINY_FACTS, **fact_changes}
    request = ReplayRequest(source["store"], run, list(layers), 0, 1, 0, 1, False, 2, facts)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi.replay.extract", str(tmp_path / "out.npy")],
        input=request.to_json(),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return proc.returncode, proc.stderr.strip().splitlines()[
        -1
    ] if proc.stderr.strip() else ""  # after library warnings


def test_extraction_refuses_a_run_that_does_not_exist(tmp_path, source):
    status, err = _extract(tmp_path, source, "no-such-run")
    assert status == 2 and err.startswith("error: no run 'no-such-run'") and "\n" not in err


@pytest.mark.parametrize(
    "changes, what",
    [
        ({"num_moe_experts": 8}, "number of experts 4, this run 8"),
        ({"moe_router_topk": 1}, "top-k 2, this run 1"),
        ({"seq_length": 16}, "sequence length 32, this run 16"),
        ({"micro_batch_size": 1}, "micro batch size 2, this run 1"),
        ({"global_batch_size": 8}, "global batch size 4, this run 8"),
        ({"num_layers": 4}, "number of layers 2, this run 4"),
    ],
)
def test_extraction_names_the_fact_that_differs(tmp_path, source, changes, what):
    status, err = _extract(tmp_path, source, None, **changes)
    assert status == 2 and what in err and "\n" not in err


def test_extraction_refuses_a_store_without_the_layers_or_runs(tmp_path, source):
    status, err = _extract(tmp_path, source, None)
    assert status == 0, err  # the source holds them
    status, err = _extract(tmp_path, source, None, layers=(0, 1, 5))
    assert status == 2 and "no router.topk_ids for layer(s) 5 (recorded layers: 0, 1)" in err
    bare = dict(source, store=str(tmp_path / "empty"))
    os.makedirs(bare["store"])
    status, err = _extract(tmp_path, bare, None)
    assert status == 2 and "is not a DMI store" in err  # a folder that is no store: named, in one line
    os.makedirs(os.path.join(bare["store"], "spool"))
    status, err = _extract(tmp_path, bare, None)
    assert status == 2 and "holds no runs" in err  # a store nothing was written to


def test_a_mismatch_stops_training_before_the_first_step(tmp_path_factory, source):
    tmp = str(tmp_path_factory.mktemp("mismatch"))
    args = _with(tiny_moe_args(), "--global-batch-size", "8") + ["--dmi-replay-routing", source["store"]]
    proc = run_pretrain(args, tmp, oracle=False, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "iteration        1/" not in out and "Traceback" not in out
    assert "error: --dmi-replay-routing " in out and "global batch size 4, this run 8" in out


def test_an_iteration_the_source_lacks_stops_by_default(tmp_path_factory, source):
    tmp = str(tmp_path_factory.mktemp("longer"))
    args = _with(tiny_moe_args(), "--train-iters", "5") + ["--dmi-replay-routing", source["store"]]
    proc = run_pretrain(args, tmp, oracle=False, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert (
        "error: --dmi-replay-routing: stored run" in out and "no usable routing for iteration 5 (not captured)" in out
    )


def test_the_live_policy_routes_missing_iterations_live_and_counts_them(tmp_path_factory, source):
    tmp = str(tmp_path_factory.mktemp("fallback"))
    args = _with(tiny_moe_args(), "--train-iters", "5")
    args += ["--dmi-replay-routing", source["store"], "--dmi-replay-missing", "live"]
    out = run_pretrain(args, tmp, oracle=False).stdout
    assert re.search(r"DMI \|.*fallbacks to live: 0 \|", out)  # iterations 1-4 replayed
    assert re.search(
        r"routing replayed from run \S+: 8 microbatches, 0 recomputed router forwards, fallbacks to live: 2", out
    )


def test_routing_diff_is_zero_against_a_replay_and_not_against_live_routing(source, self_replay, other_seed):
    _, live = other_seed
    run_id, sets = expert_sets_of(source["store"])
    assert run_id == source["run_id"] and len(sets) == 2 * 2 * 4
    same = routing_diff(sets, expert_sets_of(self_replay["store"])[1])
    assert len(same) == 2 * 4 and same["differing"].sum() == 0 and set(same["tokens"]) == {2 * 2 * 32}
    live_diff = routing_diff(sets, expert_sets_of(live["store"])[1])
    assert live_diff["differing"].sum() > 0 and live_diff["share"].between(0, 1).all()


def test_routing_diff_command_prints_the_share_per_layer_and_iteration(source, other_seed):
    replayed, _ = other_seed
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron.core.dmi",
            "routing-diff",
            source["store"],
            replayed["store"] + "@" + replayed["run_id"],
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "share of tokens whose expert set differs" in out.stdout and "overall: 0 of 1024 tokens" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", "routing-diff", source["store"], source["store"] + "@nope"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "no run 'nope'" in bad.stderr


@pytest.mark.parametrize(
    "recompute",
    [
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
        ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
    ],
    ids=["full", "selective-moe"],
)
def test_recompute_replays_each_selection_once_more(tmp_path_factory, source, recompute):
    """Every router forward is recomputed in the backward pass (REPLAY_BACKWARD), exactly once."""
    replayed = _train(tmp_path_factory, "recompute", ["--dmi-replay-routing", source["store"], *recompute])
    assert _equal(_outputs(replayed, "router.topk_ids"), _outputs(source, "router.topk_ids"))
    assert _equal(_outputs(replayed, "loss.token"), _outputs(source, "loss.token"))
    assert re.search(r"8 microbatches, 16 recomputed router forwards, fallbacks to live: 0", replayed["log"])


def test_capacity_dropping_is_decided_afresh_from_the_replayed_choice(tmp_path_factory, source):
    replayed = _train(
        tmp_path_factory, "capacity", ["--dmi-replay-routing", source["store"], "--moe-expert-capacity-factor", "0.5"]
    )
    stored, sources = _outputs(replayed, "router.topk_ids"), _outputs(source, "router.topk_ids")
    assert stored.keys() == sources.keys()
    dropped = 0
    for key, ids in stored.items():
        kept = ids < 4  # the sentinel E = 4 marks a dropped slot
        dropped += int((~kept).sum())
        for token in range(ids.shape[0]):  # what was kept is what the source chose
            assert set(ids[token][kept[token]].tolist()) <= set(sources[key][token].tolist())
    assert dropped > 0


def test_a_source_that_dropped_routes_replays_from_its_pre_drop_selection(tmp_path_factory, source):
    """Recorded under a capacity factor with router.selected, replayed under the same: the same drops
    are decided afresh, bitwise; without router.selected such a source is refused."""
    capacity = ["--moe-expert-capacity-factor", "0.5"]
    recorded = _train(
        tmp_path_factory, "capacity-source", [*capacity, "--dmi-hooks", "router.topk_ids,router.selected,loss.token"]
    )
    replayed = _train(tmp_path_factory, "capacity-replay", [*capacity, "--dmi-replay-routing", recorded["store"]])
    assert _equal(_outputs(replayed, "router.topk_ids"), _outputs(recorded, "router.topk_ids"))
    assert _equal(_outputs(replayed, "loss.token"), _outputs(recorded, "loss.token"))
    status, err = _extract(tmp_path_factory.mktemp("x"), replayed, None)  # the replay recorded no router.selected
    assert status == 2 and "dropped routes by capacity" in err and "router.selected" in err
