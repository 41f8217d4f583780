"""Routing replay end to end (CPU, real pretrain_gpt.py processes, real chDB): a run records its
routing, others replay it with --dmi-replay-routing and record their own."""

import os
import re

import pytest
import torch

from tests.functional_tests.launch import dump_store, run_pretrain, tiny_moe_args

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


def test_self_replay_gives_the_source_ids_and_bitwise_losses(source, self_replay):
    ids = _outputs(source, "router.topk_ids")
    assert len(ids) == 2 * 2 * 4  # layers x microbatches x iterations
    assert _equal(_outputs(self_replay, "router.topk_ids"), ids)
    losses = _outputs(source, "loss.token")
    assert losses and _equal(_outputs(self_replay, "loss.token"), losses)


def test_another_seed_follows_the_stored_routing(source, other_seed):
    replayed, live = other_seed
    assert _equal(_outputs(replayed, "router.topk_ids"), _outputs(source, "router.topk_ids"))
    assert not _equal(_outputs(live, "router.topk_ids"), _outputs(source, "router.topk_ids"))
    assert not _equal(_outputs(replayed, "loss.token"), _outputs(live, "loss.token"))


def test_log_line_and_report_count_replayed_microbatches(self_replay):
    assert "routing replayed from run" in self_replay["log"]
    assert re.search(r"routing replayed from run \S+: 8 microbatches, fallbacks to live: 0", self_replay["log"])
