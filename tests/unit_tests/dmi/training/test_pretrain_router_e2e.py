"""The walking skeleton end to end: pretrain_gpt.py trains a tiny MoE in CPU mode with
--dmi-hooks router --dmi-persist clickhouse; what is read back from chDB equals, bitwise, what an
independent plain forward hook on the same routers saw in the same run."""

import os
import subprocess
import sys

import pytest
import torch

from tests.functional_tests.launch import REPO, dump_store, load_oracle, run_pretrain, tiny_moe_args

LAYERS, MICROBATCHES, ITERS, EXPERTS = 2, 2, 4, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("e2e"))
    store = os.path.join(tmp, "store")
    proc = run_pretrain(
        tiny_moe_args() + ["--dmi-hooks", "router", "--dmi-persist", "clickhouse", "--dmi-store-dir", store], tmp
    )
    return proc, dump_store(store, tmp), load_oracle(tmp), store


def test_record_count_is_layers_x_microbatches_x_iterations(run):
    _, dump, _, _ = run
    per_output = {}
    for r in dump["rows"]:
        per_output[r["output"]] = per_output.get(r["output"], 0) + 1
    assert per_output == {
        o: LAYERS * MICROBATCHES * ITERS
        for o in ("router.logits", "router.topk_ids", "router.topk_probs", "router.expert_counts")
    }


def test_stored_values_equal_the_oracle_bitwise(run):
    _, dump, oracle, _ = run
    assert len(oracle) == LAYERS * MICROBATCHES * ITERS
    for (iteration, microbatch, layer), seen in oracle.items():
        key = ("train", iteration, microbatch, layer)
        logits = dump["tensors"][key + ("router.logits", 0, 0)]
        ids = dump["tensors"][key + ("router.topk_ids", 0, 0)]
        probs = dump["tensors"][key + ("router.topk_probs", 0, 0)]
        assert torch.equal(logits.view(torch.int32), seen["router.logits"].view(torch.int32))
        assert int(ids.min()) >= 0 and int(ids.max()) <= EXPERTS
        # every kept slot names an expert the router really chose, with its weight
        chosen = torch.zeros_like(seen["routing_map"])
        kept = ids < EXPERTS
        rows = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(ids)
        chosen[rows[kept], ids[kept].long()] = True
        assert torch.equal(chosen, seen["routing_map"])
        assert torch.equal(probs[kept], seen["probs"][rows[kept], ids[kept].long()])


def test_run_prints_dmi_line_and_report(run):
    proc, dump, _, _ = run
    out = proc.stdout + proc.stderr
    assert " DMI | captured: " in out
    assert "DMI end-of-run report" in out and "dropped 0" in out
    assert len(dump["runs"]) >= 1


def test_show_prints_expert_load(run):
    _, dump, _, store = run
    out = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", "show", store],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert dump["run_id"] in out.stdout and "expert load" in out.stdout


def test_run_row_describes_model_layout_command_line_and_versions(run):
    _, dump, _, store = run
    import json

    attempt = dump["attempts"][-1]
    model, layout = json.loads(attempt["model_json"]), json.loads(attempt["layout_json"])
    assert model["num_layers"] == LAYERS and model["num_moe_experts"] == EXPERTS and model["moe_router_topk"] == 2
    assert model["seq_length"] > 0 and "moe_token_drop_policy" in model
    assert layout == {"world_size": 1, "tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "etp": 1, "dp": 1}
    assert "--dmi-hooks" in list(attempt["command_line"])
    versions = json.loads(attempt["versions_json"])
    assert {"torch", "megatron-core", "megatron-dmi", "chdb", "pyarrow"} <= set(versions)
    out = subprocess.run(
        [sys.executable, "-m", "megatron.core.dmi", "describe", store, "--config"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "layout: world_size=1 tp=1" in out.stdout and f"num_moe_experts={EXPERTS}" in out.stdout
    described = json.loads(out.stdout[out.stdout.index("{") :])
    assert described["model"] == model and described["command_line"] == list(attempt["command_line"])
