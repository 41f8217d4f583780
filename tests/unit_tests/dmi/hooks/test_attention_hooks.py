"""Attention hooks on real megatron-core core attention, compared bitwise with a plain PyTorch
forward hook that copies the same tensors synchronously in the same forward."""

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
