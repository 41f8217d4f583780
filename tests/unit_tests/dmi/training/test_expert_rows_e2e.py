"""mlp.experts end to end: pretrain_gpt.py trains the tiny MoE in CPU mode with --dmi-hooks
mlp.experts,mlp.out,router; read back through the store, every MoE layer and microbatch has one
record, each row names its token and slot consistently with the stored router.topk_ids, and a
token's rows added in row order give the stored mlp.out bitwise."""

import os

import pytest
import torch

from tests.functional_tests.launch import dump_store, run_pretrain, tiny_moe_args
from tests.functional_tests.layouts import expected_record_counts

LAYERS, MICROBATCHES, ITERS, TOKENS, TOPK, HIDDEN = 2, 2, 4, 64, 2, 64
HOOKS = ["--dmi-hooks", "mlp.experts,mlp.out,router"]


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("experts"))
    store = os.path.join(tmp, "store")
    run_pretrain(tiny_moe_args() + HOOKS + ["--dmi-persist", "clickhouse", "--dmi-store-dir", store], tmp, oracle=False)
    return dump_store(store, tmp)


def test_record_counts_are_the_catalog_counts(dump):
    """One mlp.experts record per MoE layer, microbatch and iteration, whatever the routing."""
    counts = {}
    for r in dump["rows"]:
        counts[r["output"]] = counts.get(r["output"], 0) + 1
    assert counts == expected_record_counts(tiny_moe_args() + HOOKS, world_size=1)
    assert counts["mlp.experts"] == LAYERS * MICROBATCHES * ITERS
    assert not dump["errors"]


def test_rows_read_back_name_their_slot_and_rebuild_mlp_out(dump):
    checked = 0
    for (phase, iteration, microbatch, layer, output, invocation, dp), rows in dump["tensors"].items():
        if output != "mlp.experts":
            continue
        key = (phase, iteration, microbatch, layer)
        assert rows.dtype == torch.float32 and rows.shape == (TOKENS * TOPK, HIDDEN + 3)
        expert, token, slot = rows[:, HIDDEN:].long().unbind(1)
        ids = dump["tensors"][key + ("router.topk_ids", invocation, dp)].long()
        assert torch.equal(ids[token, slot], expert)
        mlp_out = dump["tensors"][key + ("mlp.out", invocation, dp)].reshape(-1, HIDDEN)
        rebuilt = torch.zeros(TOKENS, HIDDEN).index_add_(0, token, rows[:, :HIDDEN])
        assert torch.equal(rebuilt.view(torch.int32), mlp_out.view(torch.int32))
        checked += 1
    assert checked == LAYERS * MICROBATCHES * ITERS
