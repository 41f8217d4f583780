"""--dmi-replay-routing's start-up refusals: one line naming the flag combination it cannot replay."""

import argparse

import pytest

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.replay.extract import check_facts, source_microbatch
from megatron.core.dmi.replay.request import ReplayRequest, ReplaySourceError
from megatron.core.dmi.store_address import StoreRunSpecError, parse_store_run
from megatron.training.dmi.arguments import check_replay_args


def _args(tmp_path, **changes) -> argparse.Namespace:
    values = dict(
        dmi_replay_routing=str(tmp_path),
        num_experts=4,
        cuda_graph_impl="none",
        moe_router_fusion=False,
        moe_router_load_balancing_type="aux_loss",
        mtp_num_layers=None,
        context_parallel_size=1,
    )
    values.update(changes)
    return argparse.Namespace(**values)


@pytest.mark.parametrize(
    "changes, flag",
    [
        ({"num_experts": None}, "--num-experts"),
        ({"cuda_graph_impl": "local"}, "--cuda-graph-impl"),
        ({"moe_router_fusion": True}, "--moe-router-fusion"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "--moe-router-load-balancing-type"),
        ({"mtp_num_layers": 1}, "--mtp-num-layers"),
        ({"context_parallel_size": 2}, "--context-parallel-size"),
    ],
)
def test_a_combination_replay_cannot_follow_is_refused_naming_the_flag(tmp_path, changes, flag):
    with pytest.raises(SystemExit) as exc:
        check_replay_args(_args(tmp_path, **changes))
    message = str(exc.value)
    assert message.startswith("error: argument --dmi-replay-routing: ") and flag in message and "\n" not in message


def test_a_store_directory_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no DMI store at .*nowhere"):
        check_replay_args(_args(tmp_path, dmi_replay_routing=str(tmp_path / "nowhere") + "@run-1"))
    check_replay_args(_args(tmp_path))  # an existing store passes the start-up checks


@pytest.mark.parametrize("spec", ["", "@run", "store@"])
def test_a_malformed_source_is_a_config_error(spec):
    with pytest.raises(StoreRunSpecError, match="STORE\\[@RUN\\]"):
        DMIConfig(replay_routing=spec)


def test_the_source_names_a_store_and_optionally_a_run():
    assert parse_store_run("/data/dmi") == ("/data/dmi", None)
    assert parse_store_run("/data/a@b/dmi@run-1") == ("/data/a@b/dmi", "run-1")


def test_the_first_fact_that_differs_is_named():
    stored = {"num_layers": 2, "num_moe_experts": 4, "moe_router_topk": 2, "seq_length": 32}
    check_facts(stored, dict(stored), "r")
    with pytest.raises(ReplaySourceError, match="stored run r has number of experts 4, this run 8"):
        check_facts(stored, {**stored, "num_moe_experts": 8}, "r")
    with pytest.raises(ReplaySourceError, match="sequence length 32, this run 64"):
        check_facts(stored, {**stored, "seq_length": 64}, "r")


def test_microbatches_map_across_data_parallel_sizes():
    """The sampler's order: step sample run m * DP + dp, so a source with another DP size holds the same
    samples at another (microbatch, dp)."""

    def request(dp, dp_size):
        return ReplayRequest("s", None, [0], dp, dp_size, 0, 1, False, 4 // dp_size)

    # DP=1 replaying a DP=2 source: microbatches 0..3 are (0,0), (0,1), (1,0), (1,1)
    assert [source_microbatch(request(0, 1), m, 2) for m in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # DP=2 replaying a DP=1 source: rank 1's microbatch 1 is the source's fourth
    assert source_microbatch(request(1, 2), 1, 1) == (3, 0)
