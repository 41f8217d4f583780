"""Attention hooks on real megatron-core core attention: compared bitwise with a plain PyTorch
forward hook on the same module (the wiring), and with what the outputs mean, taken elsewhere: the
context is the output projection's input, and the post-RoPE query and key are recomputed from the
layer's input with the layer's own norm, QKV projection and the model's rotary embedding."""

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron.core.dmi.hooks import HookSet
from tests.unit_tests.dmi.hooks.model_fixtures import BATCH, SEQ, capture_for, tiny_gpt, tokens


@pytest.mark.parametrize("groups", [None, 2])  # MHA and GQA
def test_attention_outputs_match_a_plain_hook(megatron_cpu, groups):
    model = tiny_gpt(num_query_groups=groups)
    capture = capture_for("attn,attn.q,attn.k")
    HookSet(capture).attach(model)
    oracle = {}

    def make(layer):
        def hook(module, args, output):
            oracle[(layer, "attn.q")] = args[0].detach().clone()
            oracle[(layer, "attn.k")] = args[1].detach().clone()
            oracle[(layer, "attn.context")] = output.detach().clone()

        return hook

    for m in model.modules():
        if hasattr(m, "self_attention"):
            m.self_attention.core_attention.register_forward_hook(make(m.layer_number - 1))
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    records = {(r.key.layer, r.key.output): r for r in capture.transport.take(100, 0)}
    assert set(records) == set(oracle)
    heads, kv_heads, head_dim = 4, groups or 4, 8
    for k, want in oracle.items():
        got = records[k].tensor()
        assert got.dtype == want.dtype and torch.equal(got, want), k
    assert records[(0, "attn.q")].key.shape == (SEQ, BATCH, heads, head_dim)
    assert records[(0, "attn.k")].key.shape == (SEQ, BATCH, kv_heads, head_dim)
    assert records[(0, "attn.context")].key.shape == (SEQ, BATCH, heads * head_dim)
    assert isinstance(model.decoder.layers[0].self_attention.core_attention, DotProductAttention)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _query_key_from_layer_input(layer, hidden: torch.Tensor, freqs: torch.Tensor, heads: int, groups: int):
    """The layer's post-RoPE query [s, b, heads, d] and key [s, b, groups, d] from its input: the input
    norm, the fused QKV projection (per query group: its query heads, then one key and one value
    head), then the rotary embedding t * cos + rotate_half(t) * sin."""
    mixed, _ = layer.self_attention.linear_qkv(layer.input_layernorm(hidden))
    s, b = mixed.shape[:2]
    per_group = heads // groups
    head_dim = mixed.shape[-1] // (groups * (per_group + 2))
    mixed = mixed.view(s, b, groups, (per_group + 2) * head_dim)
    query, key, _ = mixed.split([per_group * head_dim, head_dim, head_dim], dim=-1)
    query = query.reshape(s, b, heads, head_dim)
    cos, sin = freqs.cos().to(query.dtype), freqs.sin().to(query.dtype)
    return [t * cos + _rotate_half(t) * sin for t in (query, key)]


@pytest.mark.parametrize("groups", [None, 2])  # MHA and GQA
def test_attention_outputs_match_their_meaning_taken_at_other_modules(megatron_cpu, groups):
    model = tiny_gpt(num_query_groups=groups)
    capture = capture_for("attn,attn.q,attn.k")
    HookSet(capture).attach(model)
    layer_inputs, projection_inputs = {}, {}

    def keep_layer_input(number):
        def hook(module, args, kwargs):
            layer_inputs[number] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach().clone()

        return hook

    def keep_projection_input(number):
        def hook(module, args):
            projection_inputs[number] = args[0].detach().clone()

        return hook

    layers = list(model.decoder.layers)
    for layer in layers:
        layer.register_forward_pre_hook(keep_layer_input(layer.layer_number - 1), with_kwargs=True)
        layer.self_attention.linear_proj.register_forward_pre_hook(keep_projection_input(layer.layer_number - 1))
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    records = {(r.key.layer, r.key.output): r.tensor() for r in capture.transport.take(100, 0)}
    freqs = model.rotary_pos_emb(SEQ)
    with torch.no_grad():
        for layer in layers:
            number = layer.layer_number - 1
            assert torch.equal(records[(number, "attn.context")], projection_inputs[number]), number
            query, key = _query_key_from_layer_input(layer, layer_inputs[number], freqs, 4, groups or 4)
            assert torch.equal(records[(number, "attn.q")], query), number
            assert torch.equal(records[(number, "attn.k")], key), number


def test_attention_block_output_is_the_projections_output_and_completes_the_residual_stream(megatron_cpu):
    """attn.out is the output projection's output; with mlp.out it adds up the residual stream:
    resid.in of layer 1 = resid.in + attn.out + mlp.out of layer 0 (no biases, no dropout), bitwise."""
    model = tiny_gpt()
    capture = capture_for("attn.out,resid.in,mlp.out")
    HookSet(capture).attach(model)
    projection_outputs = {}

    def keep_projection_output(number):
        def hook(module, args, output):
            projection_outputs[number] = output[0].detach().clone()

        return hook

    for layer in model.decoder.layers:
        layer.self_attention.linear_proj.register_forward_hook(keep_projection_output(layer.layer_number - 1))
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    records = {(r.key.layer, r.key.output): r for r in capture.transport.take(100, 0)}
    assert {o for _, o in records} == {"attn.out", "resid.in", "mlp.out"}
    for number, want in projection_outputs.items():
        assert torch.equal(records[(number, "attn.out")].tensor(), want), number
    assert records[(0, "attn.out")].key.shape == (SEQ, BATCH, 32)
    layer0 = {o: records[(0, o)].tensor() for o in ("resid.in", "attn.out", "mlp.out")}
    assert torch.equal(records[(1, "resid.in")].tensor(), layer0["resid.in"] + layer0["attn.out"] + layer0["mlp.out"])


def test_attention_block_output_is_opt_in():
    from megatron.core.dmi.catalog import parse_hooks

    assert "attn.out" not in parse_hooks("attn") and "attn.out" in parse_hooks("all")
