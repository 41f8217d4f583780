"""Router hooks on real megatron-core TopKRouters, compared bitwise with an independent oracle:
a plain forward hook on the same routers that calls megatron-core's own gating and routing."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter

from megatron.core.dmi.hooks import HookSet
from tests.unit_tests.dmi.hooks.model_fixtures import BATCH, EXPERTS, SEQ, TOPK, capture_for, tiny_gpt, tokens


def oracle_hooks(model):
    """Per layer: what the router saw and decided, taken without DMI."""
    seen = {}

    def make(layer):
        def hook(router, args, output):
            with torch.no_grad():
                logits = router.gating(args[0]).reshape(-1, EXPERTS)
                pre_probs, pre_map = topk_routing_with_score_function(logits, TOPK, score_function="softmax")
            probs, routing_map = output
            seen[layer] = (logits, pre_probs, pre_map, probs.detach(), routing_map)

        return hook

    handles = []
    for _name, m in model.named_modules():
        if isinstance(m, TopKRouter):
            handles.append(m.register_forward_hook(make(m.layer_number - 1)))
    return seen, handles


def expected_topk(pre_probs, pre_map, probs, routing_map):
    """Slow, obviously-correct version: per token, chosen experts by (-prob, id); dropped -> E."""
    ids, weights = [], []
    for t in range(pre_map.shape[0]):
        chosen = sorted((e for e in range(EXPERTS) if pre_map[t, e]), key=lambda e: (-float(pre_probs[t, e]), e))
        ids.append([e if routing_map[t, e] else EXPERTS for e in chosen])
        weights.append([probs[t, e] if routing_map[t, e] else 0.0 for e in chosen])
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=probs.dtype)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_router_outputs_match_the_oracle_bitwise(megatron_cpu, capacity_factor):
    model = tiny_gpt(capacity_factor=capacity_factor)
    capture = capture_for("router,router.selected")
    hooks = HookSet(capture)
    hooks.attach(model)
    seen, handles = oracle_hooks(model)
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    records = {(r.key.layer, r.key.output): r for r in capture.transport.take(100, 0)}
    assert len(records) == 2 * 5  # 2 layers x 5 router outputs
    dropped_any = False
    for layer, (logits, pre_probs, pre_map, probs, routing_map) in seen.items():
        ids, weights = expected_topk(pre_probs, pre_map, probs, routing_map)
        got = {
            o: records[(layer, o)].tensor()
            for o in (
                "router.logits",
                "router.topk_ids",
                "router.topk_probs",
                "router.expert_counts",
                "router.selected",
            )
        }
        assert torch.equal(got["router.logits"].view(torch.int32), logits.view(torch.int32))
        assert torch.equal(got["router.topk_ids"], ids)
        assert torch.equal(got["router.topk_probs"].view(torch.int32), weights.view(torch.int32))
        counts = torch.stack([pre_map.sum(0), routing_map.sum(0)]).int()
        assert torch.equal(got["router.expert_counts"], counts)
        assert int(got["router.topk_ids"].min()) >= 0 and int(got["router.topk_ids"].max()) <= EXPERTS
        dropped_any |= bool((got["router.topk_ids"] == EXPERTS).any())
        # router.selected: every pre-drop choice (no sentinel), in router.topk_ids' slot order
        chosen = torch.zeros_like(pre_map).scatter_(1, got["router.selected"].long(), True)
        assert torch.equal(chosen, pre_map)
        kept = got["router.topk_ids"] < EXPERTS
        assert torch.equal(got["router.topk_ids"][kept], got["router.selected"][kept])
        key = records[(layer, "router.logits")].key
        assert (key.token_start, key.token_end, key.token_total) == (0, SEQ * BATCH, SEQ * BATCH)
    assert dropped_any == (capacity_factor is not None)  # factor 0.5 must drop routes
    for h in handles:
        h.remove()
    hooks.remove()


def test_remove_restores_the_router(megatron_cpu):
    model = tiny_gpt()
    capture = capture_for("router")
    hooks = HookSet(capture)
    hooks.attach(model)
    hooks.remove()
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    assert capture.transport.pending() == 0
    assert all("routing" not in vars(m) for m in model.modules() if isinstance(m, TopKRouter))


def test_selection_skips_layers_and_iterations(megatron_cpu):
    model = tiny_gpt()
    capture = capture_for("router.topk_ids", layers=frozenset({1}), interval=2)
    HookSet(capture).attach(model)
    for it in (1, 2, 3):
        capture.begin_step("train", it)
        model(*tokens(it), attention_mask=None)
    got = [(r.key.iteration, r.key.layer, r.key.output) for r in capture.transport.take(100, 0)]
    assert got == [(1, 1, "router.topk_ids"), (3, 1, "router.topk_ids")]
