"""Residual-stream and MLP hooks on a real megatron-core GPT, compared bitwise with plain PyTorch
hooks on other modules than DMI's sites: the layer's own inputs and outputs and the MoE block's
output, copied synchronously in the same forward."""

import pytest
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.hooks import HookSet
from tests.unit_tests.dmi.hooks.model_fixtures import BATCH, EXPERTS, SEQ, bits, capture_for, tiny_gpt, tokens
from tests.unit_tests.dmi.test_capture_replay import RECOMPUTE, train_step

HIDDEN = 32


def layer_oracle(model):
    """(layer, what) -> tensor: each layer's input and output and its MLP block's output."""
    seen = {}

    def inputs(layer):
        def hook(module, args, kwargs):
            seen[(layer, "input")] = kwargs["hidden_states"].detach().clone()

        return hook

    def outputs(layer):
        def hook(module, args, kwargs, output):
            seen[(layer, "output")] = output[0].detach().clone()

        return hook

    def mlp(layer):
        def hook(module, args, output):
            seen[(layer, "mlp")] = output[0].detach().clone()

        return hook

    for m in model.modules():
        if isinstance(m, TransformerLayer):
            layer = m.layer_number - 1
            m.register_forward_pre_hook(inputs(layer), with_kwargs=True)
            m.register_forward_hook(outputs(layer), with_kwargs=True)
            m.mlp.register_forward_hook(mlp(layer))
    return seen


def test_resid_and_mlp_outputs_match_plain_hooks(megatron_cpu):
    model = tiny_gpt()
    capture = capture_for("resid,mlp")
    HookSet(capture).attach(model)
    seen = layer_oracle(model)
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    records = {(r.key.layer, r.key.output): r for r in capture.transport.take(100, 0)}
    assert set(records) == {
        (0, "resid.in"),
        (1, "resid.in"),
        (1, "resid.out"),
        (0, "mlp.out"),
        (1, "mlp.out"),
        (0, "router.weight"),
        (1, "router.weight"),
    }
    for layer in (0, 1):
        got = records[(layer, "resid.in")].tensor()
        assert got.shape == (SEQ, BATCH, HIDDEN) and torch.equal(bits(got), bits(seen[(layer, "input")]))
        assert torch.equal(bits(records[(layer, "mlp.out")].tensor()), bits(seen[(layer, "mlp")]))
        router = model.decoder.layers[layer].mlp.router
        weight = records[(layer, "router.weight")]
        assert weight.key.shape == (EXPERTS, HIDDEN) and torch.equal(
            bits(weight.tensor()), bits(router.weight.detach())
        )
    # the last layer's output is what the final norm receives
    assert torch.equal(bits(records[(1, "resid.out")].tensor()), bits(seen[(1, "output")]))
    # the residual stream is continuous: layer 1's input is layer 0's output
    assert torch.equal(bits(records[(1, "resid.in")].tensor()), bits(seen[(0, "output")]))
    key = records[(0, "resid.in")].key
    assert (key.token_start, key.token_end, key.token_total, key.shard_count) == (0, SEQ, SEQ, 1)


def test_router_weight_once_per_iteration(megatron_cpu):
    """Only microbatch 0 publishes the router weight; the iteration's later microbatches do not."""
    model = tiny_gpt()
    capture = capture_for("router.weight")
    HookSet(capture).attach(model)
    for it in (1, 2):
        capture.begin_step("train", it)
        for mb in range(3):
            capture.set_microbatch(mb)
            model(*tokens(mb), attention_mask=None)
    got = sorted((r.key.iteration, r.key.microbatch, r.key.layer) for r in capture.transport.take(100, 0))
    assert got == [(1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1)]


def test_resid_out_without_final_norm_is_the_last_layer_output(megatron_cpu):
    model = tiny_gpt()
    model.decoder.final_layernorm = None  # a block that ends without a norm (post_layer_norm=False)
    capture = capture_for("resid.out")
    HookSet(capture).attach(model)
    seen = layer_oracle(model)
    capture.begin_step("train", 1)
    model.decoder(model.embedding(*tokens()), attention_mask=None)
    (record,) = capture.transport.take(100, 0)
    assert record.key.layer == 1 and torch.equal(bits(record.tensor()), bits(seen[(1, "output")]))


def test_dense_model_records_no_router_weight(megatron_cpu):
    model = tiny_gpt(num_experts=None)
    capture = capture_for("resid")
    HookSet(capture).attach(model)
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    assert sorted((r.key.layer, r.key.output) for r in capture.transport.take(100, 0)) == [
        (0, "resid.in"),
        (1, "resid.in"),
        (1, "resid.out"),
    ]


@pytest.mark.parametrize("record_replays", [False, True])
def test_full_recompute_records_each_once_or_keeps_the_replay(megatron_cpu, record_replays):
    """Full recompute re-runs every layer inside backward: resid.in and mlp.out fire twice, resid.out
    (outside the recomputed layers) and router.weight (block pre-hook) once."""
    model = tiny_gpt(recompute=RECOMPUTE["full"])
    capture = capture_for("resid,mlp", record_replays=record_replays)
    HookSet(capture).attach(model)
    model.capture = capture
    capture.begin_step("train", 1)
    train_step(model)
    records = capture.transport.take(1000, 0)
    originals = [r for r in records if r.key.invocation == 0]
    replays = [r for r in records if r.key.invocation == 1]
    per_output = {}
    for r in originals:
        per_output[r.key.output] = per_output.get(r.key.output, 0) + 1
    assert per_output == {"resid.in": 4, "mlp.out": 4, "resid.out": 2, "router.weight": 2}
    if not record_replays:
        assert replays == [] and capture.stats.replays_rejected == 8
        return
    assert sorted((r.key.microbatch, r.key.layer, r.key.output) for r in replays) == sorted(
        (mb, layer, o) for mb in (0, 1) for layer in (0, 1) for o in ("resid.in", "mlp.out")
    )
    by_key = {(r.key.microbatch, r.key.layer, r.key.output): r for r in originals}
    for r in replays:
        assert r.payload == by_key[(r.key.microbatch, r.key.layer, r.key.output)].payload


def test_shared_expert_output_matches_a_plain_hook(megatron_cpu):
    model = tiny_gpt(shared_expert_size=32)
    capture = capture_for("mlp")
    HookSet(capture).attach(model)
    seen = {}
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            m.mlp.shared_experts.register_forward_hook(
                lambda mod, args, out, layer=m.layer_number - 1: seen.update({layer: out.detach().clone()})
            )
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    records = {(r.key.layer, r.key.output): r for r in capture.transport.take(100, 0)}
    assert set(records) == {(layer, o) for layer in (0, 1) for o in ("mlp.out", "mlp.shared")}
    for layer in (0, 1):
        got = records[(layer, "mlp.shared")].tensor()
        assert got.shape == (SEQ, BATCH, HIDDEN) and torch.equal(bits(got), bits(seen[layer]))
