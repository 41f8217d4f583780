"""Routing replay across parallel layouts (CPU, real gloo processes): each rank extracts only its
own layers and microbatches, mapped through Megatron's sampler order."""

import os

import pytest
import torch

from tests.functional_tests.launch import dump_store, run_pretrain, tiny_moe_args

HOOKS = ["--dmi-hooks", "router.topk_ids", "--dmi-persist", "clickhouse"]
LAYERS, ITERS = 2, 4


def _train(tmp_path_factory, name: str, extra: list[str], nproc: int = 1) -> dict:
    tmp = str(tmp_path_factory.mktemp(name))
    store = os.path.join(tmp, "store")
    run_pretrain(tiny_moe_args() + HOOKS + ["--dmi-store-dir", store] + extra, tmp, nproc=nproc, oracle=False)
    dump = dump_store(store, tmp)
    dump["store"] = store
    return dump


def _ids(dump: dict) -> dict:
    """(iteration, microbatch, layer, dp) -> router.topk_ids, each token's expert set sorted."""
    return {
        (k[1], k[2], k[3], k[6]): v.sort(1).values
        for k, v in dump["tensors"].items()
        if k[0] == "train" and k[4] == "router.topk_ids" and k[5] == 0
    }


def _replayed(tmp_path_factory, name: str, source: dict, layout: list[str]) -> dict:
    """The ids stored by a two-process run in ``layout`` that replays ``source``."""
    return _ids(_train(tmp_path_factory, name, [*layout, "--dmi-replay-routing", source["store"]], nproc=2))


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    return _train(tmp_path_factory, "tp1", [])


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    return _train(tmp_path_factory, "ep2", ["--expert-model-parallel-size", "2"], nproc=2)


def test_record_ep2_replay_tp1(tmp_path_factory, ep2):
    """EP=2 on two processes is DP=2 (one microbatch each); a one-process replay holds both as microbatches 0, 1."""
    source = _ids(ep2)
    replayed = _ids(_train(tmp_path_factory, "ep2-to-tp1", ["--dmi-replay-routing", ep2["store"]]))
    assert len(source) == len(replayed) == LAYERS * ITERS * 2
    for (it, mb, layer, dp), ids in replayed.items():
        assert dp == 0 and torch.equal(ids, source[(it, 0, layer, mb)]), (it, mb, layer)


def test_record_tp1_replay_ep2(tmp_path_factory, tp1):
    source = _ids(tp1)
    replayed = _replayed(tmp_path_factory, "tp1-to-ep2", tp1, ["--expert-model-parallel-size", "2"])
    assert len(source) == len(replayed) == LAYERS * ITERS * 2
    for (it, mb, layer, dp), ids in replayed.items():
        assert mb == 0 and torch.equal(ids, source[(it, dp, layer, 0)]), (it, dp, layer)


@pytest.mark.parametrize(
    "layout",
    [
        ["--pipeline-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        # experts not split across the tensor-parallel ranks (ETP=1 under TP=2): routing is per SP shard still
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    ],
    ids=["pp2", "tp2-sp", "tp2-sp-etp1"],
)
def test_record_tp1_replay_in_another_layout(tmp_path_factory, tp1, layout):
    """Each pipeline stage extracts only its own layer; each tensor-parallel rank under sequence
    parallelism only its own sequence shard of every microbatch."""
    replayed = _replayed(tmp_path_factory, "tp1-to-" + "-".join(layout).replace("--", ""), tp1, layout)
    source = _ids(tp1)
    assert replayed.keys() == source.keys()
    assert all(torch.equal(replayed[k], source[k]) for k in source)


def test_record_tp1_replay_pp2_with_virtual_stages(tmp_path_factory):
    """Four layers, two stages of two virtual chunks: each chunk's routers take the ids of that chunk's microbatch."""
    four = ["--num-layers", "4"]
    source = _train(tmp_path_factory, "tp1-4layers", four)
    vpp = [*four, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    replayed = _replayed(tmp_path_factory, "tp1-to-pp2-vpp2", source, vpp)
    assert replayed.keys() == _ids(source).keys() and len(replayed) == 4 * ITERS * 2
    assert all(torch.equal(replayed[k], _ids(source)[k]) for k in replayed)


def test_record_tp2_sp_replay_tp1(tmp_path_factory):
    """The reverse: a run recorded on two sequence shards replays on one process, whole sequences."""
    source = _train(tmp_path_factory, "tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], nproc=2)
    replayed = _ids(_train(tmp_path_factory, "tp2-sp-to-tp1", ["--dmi-replay-routing", source["store"]]))
    assert replayed.keys() == _ids(source).keys() and len(replayed) == LAYERS * ITERS * 2
    assert all(torch.equal(replayed[k], _ids(source)[k]) for k in replayed)


def test_record_pp2_replay_tp1(tmp_path_factory):
    """A run recorded on two pipeline stages (each stage stored its own layer) replays on one process."""
    source = _train(tmp_path_factory, "pp2", ["--pipeline-model-parallel-size", "2"], nproc=2)
    replayed = _ids(_train(tmp_path_factory, "pp2-to-tp1", ["--dmi-replay-routing", source["store"]]))
    assert replayed.keys() == _ids(source).keys() and len(replayed) == LAYERS * ITERS * 2
    assert all(torch.equal(replayed[k], _ids(source)[k]) for k in replayed)
