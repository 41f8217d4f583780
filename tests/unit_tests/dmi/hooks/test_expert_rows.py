"""mlp.experts on a real megatron-core MoE GPT: bitwise against a plain forward hook on the experts
module, token indices and slots against the router's own routing map and top-k order, and the rows
summed per token against mlp.out."""

import pytest
import torch

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.hooks import HookSet
from megatron.core.dmi.reader.reconstruct import rebuild_expert_rows
from tests.unit_tests.dmi.hooks.model_fixtures import BATCH, EXPERTS, SEQ, TOPK, bits, capture_for, tiny_gpt, tokens
from tests.unit_tests.dmi.test_capture_replay import RECOMPUTE, train_step

HIDDEN = 32


def experts_oracle(model):
    """layer -> the experts' input and output rows and the router's (probs, routing map), seen by plain
    hooks in the same forward."""
    seen = {}
    for layer, block in enumerate(model.decoder.layers):

        def rows(module, args, output, layer=layer):
            seen.setdefault(layer, {}).update(inputs=args[0].detach().clone(), rows=output[0].detach().clone())

        def routing(module, args, output, layer=layer):
            probs, routing_map = output
            seen.setdefault(layer, {}).update(probs=probs.detach().clone(), map=routing_map.clone())

        block.mlp.experts.register_forward_hook(rows)
        block.mlp.router.register_forward_hook(routing)
    return seen


def capture_experts(model, hooks="mlp.experts,mlp.out,router"):
    capture = capture_for(hooks)
    HookSet(capture).attach(model)
    seen = experts_oracle(model)
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    return {(r.key.layer, r.key.output): r for r in capture.transport.take(100, 0)}, seen


def rebuilt(records, layer):
    """The reader's [rows, h + 3] view of one layer's record (one process: rank 0, dp 0, tp 0)."""
    return torch.from_numpy(rebuild_expert_rows([records[(layer, "mlp.experts")]], {0: (0, 0)}, 0))


DISPATCHERS = pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])


@DISPATCHERS
def test_rows_match_a_plain_hook_and_name_their_token_and_slot(megatron_cpu, dispatcher):
    """With one rank both dispatchers hand the experts the rows by expert, tokens ascending: the
    allgather path records the experts' output, the alltoall path the rows the combine brings back."""
    records, seen = capture_experts(tiny_gpt(dispatcher=dispatcher))
    for layer in (0, 1):
        stored = records[(layer, "mlp.experts")].tensor()
        rows, routing_map, probs = seen[layer]["rows"], seen[layer]["map"], seen[layer]["probs"]
        assert stored.shape == (SEQ * BATCH * TOPK, HIDDEN + 5)
        expert, source, token, per_source = stored[:, HIDDEN : HIDDEN + 4].long().unbind(1)
        assert (source == 0).all() and (per_source == SEQ * BATCH).all()
        assert torch.equal(stored[:, HIDDEN + 4], probs[token, expert])
        record = rebuilt(records, layer)
        assert record.shape == (SEQ * BATCH * TOPK, HIDDEN + 3)
        assert torch.equal(bits(record[:, :HIDDEN]), bits(rows))
        assert torch.equal(bits(stored[:, :HIDDEN]), bits(rows))
        expert, token, slot = record[:, HIDDEN:].long().unbind(1)
        # one row per (token, chosen expert), by expert then token, as the router chose them
        chosen = torch.zeros_like(routing_map)
        chosen[token, expert] = True
        assert torch.equal(chosen, routing_map)
        assert torch.equal(expert * SEQ * BATCH + token, (expert * SEQ * BATCH + token).sort().values)
        ids = records[(layer, "router.topk_ids")].tensor().long()
        assert torch.equal(ids[token, slot], expert)
        weights = records[(layer, "router.topk_probs")].tensor()
        assert torch.equal(weights[token, slot], probs[token, expert])


@DISPATCHERS
def test_rows_rebuild_mlp_out(megatron_cpu, dispatcher):
    """A token's rows sum to mlp.out: adding them in row order, as the dispatcher's unpermute does,
    gives the same bits. The rows are already weighted: each is its expert's output for the token
    scaled by the routing probability (the experts apply it in their activation, so that check is
    allclose: the unweighted output rounds differently)."""
    model = tiny_gpt(dispatcher=dispatcher)
    records, seen = capture_experts(model)
    for layer in (0, 1):
        record = rebuilt(records, layer)
        expert, token, slot = record[:, HIDDEN:].long().unbind(1)
        summed = torch.zeros(SEQ * BATCH, HIDDEN).index_add_(0, token, record[:, :HIDDEN])
        mlp_out = records[(layer, "mlp.out")].tensor().reshape(-1, HIDDEN)
        assert torch.equal(bits(summed), bits(mlp_out))
        weights = records[(layer, "router.topk_probs")].tensor()[token, slot]
        local_experts = model.decoder.layers[layer].mlp.experts.local_experts
        with torch.no_grad():
            unweighted = torch.cat(
                [
                    local_experts[e](seen[layer]["inputs"][expert == e], torch.ones(int((expert == e).sum())))[0]
                    for e in range(EXPERTS)
                ]
            )
        torch.testing.assert_close(record[:, :HIDDEN], weights.unsqueeze(1) * unweighted)
        assert not torch.allclose(record[:, :HIDDEN], unweighted)


def test_one_record_per_moe_layer_and_microbatch_even_without_rows(megatron_cpu):
    """Records do not depend on the routing: experts that get no rows still publish a [0, h + 5] record."""
    model = tiny_gpt()
    capture = capture_for("mlp.experts")
    HookSet(capture).attach(model)
    capture.begin_step("train", 1)
    for mb in range(3):
        capture.set_microbatch(mb)
        model(*tokens(mb), attention_mask=None)
    got = sorted((r.key.microbatch, r.key.layer) for r in capture.transport.take(100, 0))
    assert got == [(mb, layer) for mb in range(3) for layer in (0, 1)]
    capture.set_microbatch(3)
    moe = model.decoder.layers[0].mlp
    moe.token_dispatcher.local_map = torch.zeros(SEQ * BATCH, EXPERTS, dtype=torch.bool)  # no token routed
    with torch.no_grad():
        moe.experts(torch.zeros(0, HIDDEN), torch.zeros(EXPERTS, dtype=torch.long), torch.zeros(0))
    (empty,) = capture.transport.take(100, 0)
    assert (empty.key.microbatch, empty.key.layer, empty.key.shape) == (3, 0, (0, HIDDEN + 5))
    assert (empty.key.token_start, empty.key.token_end, empty.key.token_total) == (0, 0, 0)
    assert rebuild_expert_rows([empty], {0: (0, 0)}, 0).shape == (0, HIDDEN + 3)  # the reader: an empty tensor


def test_unsupported_configuration_is_refused_at_attach(megatron_cpu):
    model = tiny_gpt(capacity_factor=1.0)
    with pytest.raises(DMIError, match="--moe-expert-capacity-factor"):
        HookSet(capture_for("mlp.experts")).attach(model)


@DISPATCHERS
@pytest.mark.parametrize("record_replays", [False, True])
def test_full_recompute_records_each_once_or_keeps_the_replay(megatron_cpu, record_replays, dispatcher):
    """Full recompute re-runs the MoE layer in backward: its rows are rejected, or kept bitwise
    equal to the original as invocation 1."""
    model = tiny_gpt(recompute=RECOMPUTE["full"], dispatcher=dispatcher)
    capture = capture_for("mlp.experts", record_replays=record_replays)
    HookSet(capture).attach(model)
    model.capture = capture
    capture.begin_step("train", 1)
    train_step(model)
    records = capture.transport.take(1000, 0)
    keys = sorted((r.key.invocation, r.key.microbatch, r.key.layer) for r in records)
    originals = [(0, mb, layer) for mb in (0, 1) for layer in (0, 1)]
    if not record_replays:
        assert keys == originals and capture.stats.replays_rejected == 4
        return
    assert keys == originals + [(1, mb, layer) for mb, layer in ((0, 0), (0, 1), (1, 0), (1, 1))]
    by_key = {(r.key.invocation, r.key.microbatch, r.key.layer): r for r in records}
    for _, mb, layer in originals:
        assert by_key[(1, mb, layer)].payload == by_key[(0, mb, layer)].payload


def test_remove_restores_the_alltoall_dispatcher(megatron_cpu):
    """The alltoall path wraps each MoE layer's token_combine; removing the hooks drops the wrapper
    and a forward afterwards records nothing."""
    model = tiny_gpt(dispatcher="alltoall")
    capture = capture_for("mlp.experts")
    hooks = HookSet(capture)
    hooks.attach(model)
    dispatchers = [layer.mlp.token_dispatcher for layer in model.decoder.layers]
    assert all("token_combine" in vars(d) for d in dispatchers)
    hooks.remove()
    assert all("token_combine" not in vars(d) for d in dispatchers)
    capture.begin_step("train", 1)
    model(*tokens(), attention_mask=None)
    assert capture.transport.pending() == 0
