import pytest

from megatron.core.dmi import catalog


def shape(**overrides) -> catalog.ModelShape:
    """A tiny model's shape (seq 32, micro-batch 2, 4 heads of 16, hidden 64, TP=2 with SP, bf16)."""
    base = dict(
        seq_length=32,
        micro_batch=2,
        num_experts=8,
        topk=2,
        heads=4,
        query_groups=4,
        head_dim=16,
        hidden=64,
        tp=2,
        sequence_parallel=True,
        model_itemsize=2,
    )
    return catalog.ModelShape(**{**base, **overrides})


def test_groups_expand_to_their_default_outputs():
    assert catalog.parse_hooks("router") == {
        "router.logits",
        "router.topk_ids",
        "router.topk_probs",
        "router.expert_counts",
    }
    assert catalog.parse_hooks("attn") == {"attn.context"}  # q and k are opt-in


def test_opt_in_outputs_by_name_and_all():
    assert catalog.parse_hooks("attn,attn.q,attn.k") == {"attn.context", "attn.q", "attn.k"}
    # logits.full and mlp.experts are named only (vocabulary- and top-k-sized); grad is selected by its
    # group or names (backward hooks)
    named_only = {"logits.full", "mlp.experts"}
    grads = {"grad.router_logits", "grad.attn_context", "grad.resid_in"}
    assert catalog.parse_hooks("all") == set(catalog.BY_NAME) - named_only - grads
    assert catalog.parse_hooks("grad") == grads
    assert catalog.parse_hooks("all,grad") == set(catalog.BY_NAME) - named_only
    assert "logits.full" in catalog.parse_hooks("all,logits.full")
    assert "mlp.experts" not in catalog.parse_hooks("mlp")
    assert catalog.parse_hooks("mlp.experts") == {"mlp.experts"}
    assert catalog.parse_hooks("none") == frozenset()


@pytest.mark.parametrize(
    "spec,bad", [("router,foo", "foo"), ("router.logit", "router.logit"), ("router,,attn", "empty")]
)
def test_bad_hook_lists_name_the_bad_item(spec, bad):
    with pytest.raises(catalog.HookSelectionError, match=bad):
        catalog.parse_hooks(spec)


def test_record_sizes_follow_the_model_shape():
    m = shape(query_groups=2, router_itemsize=4)
    assert catalog.BY_NAME["router.logits"].local_shape(m)[0] == (32, 8)  # 16 local positions x 2
    assert catalog.record_bytes("router.topk_ids", m) == 32 * 2 * 4
    assert catalog.BY_NAME["attn.context"].local_shape(m)[0] == (32, 2, 2 * 16)
    assert catalog.BY_NAME["attn.k"].local_shape(m)[0] == (32, 2, 1, 16)


def test_latent_attention_and_fp32_residual_sizes():
    """Multi-latent attention's query/key and value widths differ from head_dim; the residual
    stream is fp32 under --fp32-residual-connection while the sub-layers' outputs stay bf16."""
    mla = shape(tp=1, sequence_parallel=False, qk_head_dim=16 + 8, v_head_dim=12)
    assert catalog.BY_NAME["attn.q"].local_shape(mla)[0] == (32, 2, 4, 24)
    assert catalog.BY_NAME["attn.k"].local_shape(mla)[0] == (32, 2, 4, 24)
    assert catalog.BY_NAME["attn.context"].local_shape(mla)[0] == (32, 2, 4 * 12)
    fp32_resid = shape(tp=1, sequence_parallel=False, residual_itemsize=4)
    for output in ("resid.in", "resid.out", "grad.resid_in"):
        assert catalog.record_bytes(output, fp32_resid) == 32 * 2 * 64 * 4, output
    assert catalog.record_bytes("mlp.out", fp32_resid) == 32 * 2 * 64 * 2


def test_markdown_table_lists_every_output():
    table = catalog.markdown_table()
    for o in catalog.OUTPUTS:
        assert f"`{o.name}`" in table


def test_resid_and_mlp_shapes_and_groups():
    m = shape()
    assert catalog.BY_NAME["resid.in"].local_shape(m)[0] == (16, 2, 64)  # SP: half the sequence
    assert catalog.BY_NAME["mlp.out"].local_shape(m)[0] == (16, 2, 64)
    assert catalog.record_bytes("router.weight", m) == 8 * 64 * 2
    assert catalog.parse_hooks("resid") == {"resid.in", "resid.out", "router.weight"}
    assert catalog.parse_hooks("mlp") == {"mlp.out", "mlp.shared"}
    assert catalog.layers_in_scope("mlp.shared", [0, 1, 2], 3, {1, 2}, {2}) == [2]


@pytest.mark.parametrize(
    "output,tp,sp,want",
    [
        ("router.logits", 2, True, 2),
        ("router.logits", 2, False, 1),
        ("attn.context", 2, False, 2),
        ("resid.in", 2, True, 2),
        ("resid.in", 2, False, 1),
        ("router.weight", 2, True, 1),
    ],
)
def test_producers_per_replica(output, tp, sp, want):
    assert catalog.producers_per_replica(output, tp, sp) == want
    assert catalog.producers_per_replica("router.weight", tp, sp, dp_rank0=False) == 0


def test_gradients_are_shaped_and_sharded_like_their_forward_outputs():
    m = shape()
    for forward, gradient in (
        ("router.logits", "grad.router_logits"),
        ("attn.context", "grad.attn_context"),
        ("resid.in", "grad.resid_in"),
    ):
        f, g = catalog.BY_NAME[forward], catalog.BY_NAME[gradient]
        assert g.backward and not f.backward
        assert g.local_shape(m) == f.local_shape(m)
        assert (g.combine, g.shard_dim, g.scope, g.producers) == (f.combine, f.shard_dim, f.scope, f.producers)
    assert "| `grad.resid_in` | 256 | 8,192 |" in catalog.markdown_table()


def test_scopes_pick_layers():
    assert catalog.layers_in_scope("resid.out", [0, 1, 2, 3], 4, {1, 3}) == [3]
    assert catalog.layers_in_scope("router.weight", [0, 1, 2, 3], 4, {1, 3}) == [1, 3]
    assert catalog.layers_in_scope("resid.in", [0, 2], 4, {1, 3}) == [0, 2]
    assert catalog.layers_in_scope("resid.out", [0, 1], 4, set()) == []


def test_sizes_table_gives_bytes_per_token():
    tiny = catalog.SIZE_MODELS["tiny (fp32)"]
    assert catalog.size_per_token("resid.in", tiny) == 64 * 4  # hidden x fp32
    assert catalog.size_per_token("router.weight", tiny) == 4 * 64 * 4  # whole [E, h] record
    assert "| `resid.in` | 256 | 8,192 |" in catalog.markdown_table()


def test_logits_and_loss_shapes():
    m = shape(num_experts=4, vocab=256, logits_topk=5, model_itemsize=4)
    assert catalog.BY_NAME["logits.topk"].local_shape(m)[0] == (32, 2, 5, 2)  # the full sequence under SP
    assert catalog.BY_NAME["logits.target"].local_shape(m)[0] == (32, 2, 3)
    assert catalog.BY_NAME["logits.full"].local_shape(m)[0] == (32, 2, 128)  # vocabulary shard
    assert catalog.BY_NAME["mlp.experts"].local_shape(m) == ((16 * 2 * 2, 64 + 5), 4)  # every local route, fp32
    assert catalog.producers_per_replica("mlp.experts", 2, True) == 2  # every rank its own rows
    assert catalog.BY_NAME["loss.token"].local_shape(m)[0] == (32, 2, 2)
    assert catalog.producers_per_replica("loss.token", 2, True) == 1
    assert catalog.producers_per_replica("logits.topk", 2, True) == 2
    assert catalog.parse_hooks("logits") == {"logits.topk", "logits.target"}
