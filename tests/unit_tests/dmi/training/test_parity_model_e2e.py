"""The model-side parity paths through the real entry, in one CPU training run: --mtp-num-layers
builds the MTP block and logs its loss, ModelOpt's flags parse (and say they have no effect without
nvidia-modelopt), --inprocess-restart goes through megatron.training's wrapper, and DMI captures the
decoder's layers with --dmi-hooks router,attn. Plus one refusal through the entry."""

from __future__ import annotations

import os
import re

import pytest

from tests.functional_tests.launch import dump_store, run_pretrain, tiny_moe_args
from tests.unit_tests.dmi.training.parity_models import MOE, moe_block, mtp_block, structure, upstream_model

ITERS, MICROBATCHES, LAYERS = 4, 2, 2
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
MODELOPT = ["--export-te-mcore-model", "--export-kd-teacher-load", "/teacher", "--export-kd-cfg", "kd.yaml"]
DMI_OUTPUTS = ("attn.context", "router.logits", "router.topk_ids", "router.topk_probs", "router.expert_counts")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("parity"))
    store = os.path.join(tmp, "store")
    args = tiny_moe_args() + MTP + MODELOPT + ["--inprocess-restart"]
    args += ["--dmi-hooks", "router,attn", "--dmi-persist", "clickhouse", "--dmi-store-dir", store]
    proc = run_pretrain(args, tmp, oracle=False)
    return proc.stdout + proc.stderr, store, tmp


def test_mtp_block_is_built_and_its_loss_logged(run):
    out, _, _ = run
    params = int(re.search(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): (\d+)", out)[1])
    assert params == structure(upstream_model([*MOE, *MTP], moe_block, mtp_block))[1]
    assert "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight" in out
    losses = re.findall(r"\| lm loss: \S+ \|.*?\| mtp_1 loss: (\S+) \|", out)
    assert len(losses) == ITERS and all(float(v) > 0 for v in losses)


def test_modelopt_flags_are_accepted_with_one_line_saying_they_have_no_effect(run):
    out, _, _ = run
    notices = [line for line in out.splitlines() if line.startswith("warning: argument --export-")]
    assert notices == [
        "warning: argument --export-te-mcore-model, --export-kd-teacher-load, --export-kd-cfg: no effect: "
        "nvidia-modelopt is not installed (upstream's entry then builds and trains the plain model too)"
    ]


def test_inprocess_restart_goes_through_megatron_training(run):
    out, _, _ = run
    # megatron.training's wrapper without nvidia-resiliency-ext: a warning and a plain run, as upstream
    assert "In-process restart is not available" in out
    assert f"iteration        {ITERS}/       {ITERS}" in out


def test_dmi_captures_every_decoder_layer_once_and_not_the_mtp_layers(run):
    out, store, tmp = run
    captured = re.findall(r" DMI \| captured: (\d+) records", out)
    assert int(captured[-1]) == ITERS * MICROBATCHES * LAYERS * len(DMI_OUTPUTS)
    assert "not found in the store" not in out
    rows = dump_store(store, tmp)["rows"]
    keys = [(r["iteration"], r["microbatch"], r["layer"], r["output"]) for r in rows]
    assert len(keys) == len(set(keys)) == ITERS * MICROBATCHES * LAYERS * len(DMI_OUTPUTS)


def test_a_model_flag_refusal_stops_the_entry_in_one_line(tmp_path):
    refused = ["--experimental-attention-variant", "gated_delta_net"]
    p = run_pretrain(tiny_moe_args() + refused, str(tmp_path), oracle=False, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 2  # an argument error, as argparse's
    errors = [
        line
        for line in out.splitlines()
        if line.startswith("pretrain_gpt.py: error: argument --experimental-attention-variant")
    ]
    assert len(errors) == 1 and "Transformer Engine only" in errors[0], out[-2000:]
    assert "Traceback" not in out and "building GPT model" not in out
