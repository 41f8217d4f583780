"""Gradient hooks (group ``grad``) on a real megatron-core GPT, compared bitwise with plain PyTorch
backward hooks registered independently on the same modules: the core attention's output gradient
(a full backward hook), each layer's input gradient (a full backward pre-hook on the module that
produced that input: the embedding or the previous layer), and the router logits' gradient (a
tensor hook on the gating output). Microbatches run as a pipeline schedule runs them (every
forward, then every backward), so a gradient must carry its forward's microbatch; with full and
selective recompute each gradient is recorded once, with the same bits."""

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.hooks import HookSet
from tests.unit_tests.dmi.hooks.model_fixtures import BATCH, EXPERTS, SEQ, bits, capture_for, tiny_gpt, tokens
from tests.unit_tests.dmi.test_capture_replay import RECOMPUTE

HIDDEN = 32
MICROBATCHES = 2
OUTPUTS = ("grad.router_logits", "grad.attn_context", "grad.resid_in")


class GradientOracle:
    """Gradients seen by plain PyTorch backward hooks, keyed by (microbatch, layer, output); the
    test names the microbatch whose backward runs. A hook inside a recomputed region sees only the
    replay's graph (the original forward runs without grad), so each fires once per backward."""

    def __init__(self, model):
        self.microbatch = None
        self.seen: dict[tuple[int, int, str], torch.Tensor] = {}
        layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
        # layer L's input is what the embedding (L = 0) or layer L-1 returned
        producers = [model.embedding] + layers[:-1]
        for layer, (module, producer) in enumerate(zip(layers, producers)):
            producer.register_full_backward_pre_hook(self._keep_output_gradient(layer, "grad.resid_in"))
            module.self_attention.core_attention.register_full_backward_pre_hook(
                self._keep_output_gradient(layer, "grad.attn_context")
            )
            router = module.mlp.router
            router.gating = self._gating_with_hook(router.gating, layer)

    def _keep(self, layer: int, output: str, gradient: torch.Tensor) -> None:
        key = (self.microbatch, layer, output)
        assert key not in self.seen, f"oracle saw {key} twice"
        self.seen[key] = gradient.detach().clone()

    def _keep_output_gradient(self, layer: int, output: str):
        def hook(module, grad_output):
            self._keep(layer, output, grad_output[0])

        return hook

    def _gating_with_hook(self, gating, layer: int):
        def gating_with_hook(x):
            logits = gating(x)
            if logits.requires_grad:
                logits.register_hook(lambda g: self._keep(layer, "grad.router_logits", g.reshape(-1, g.shape[-1])))
            return logits

        return gating_with_hook


def pipelined_step(model, capture, oracle, backward_order):
    """Every microbatch's forward (the capture's current microbatch set before each), then their
    backwards in ``backward_order``: when a backward runs, the current microbatch is the last forward's."""
    losses = []
    for mb in range(MICROBATCHES):
        capture.set_microbatch(mb)
        ids, pos = tokens(mb)
        losses.append(model(ids, pos, attention_mask=None, labels=ids).sum())
    for mb in backward_order:
        oracle.microbatch = mb
        losses[mb].backward()


def run(recompute: str | None, backward_order=(0, 1), hooks: str = "grad"):
    torch.manual_seed(0)
    model = tiny_gpt(recompute=RECOMPUTE[recompute] if recompute else None)
    capture = capture_for(hooks)
    HookSet(capture).attach(model)
    oracle = GradientOracle(model)
    capture.begin_step("train", 3)
    pipelined_step(model, capture, oracle, backward_order)
    return capture, oracle


@pytest.mark.parametrize("recompute", [None, "full", "selective-core_attn"])
def test_gradients_match_plain_backward_hooks_once_each(megatron_cpu, recompute):
    capture, oracle = run(recompute)
    records = capture.transport.take(1000, 0)
    keys = [(r.key.microbatch, r.key.layer, r.key.output) for r in records]
    want = {(mb, layer, o) for mb in range(MICROBATCHES) for layer in (0, 1) for o in OUTPUTS}
    assert sorted(keys) == sorted(want)  # each gradient recorded exactly once
    assert set(oracle.seen) == want
    shapes = {"grad.router_logits": (SEQ * BATCH, EXPERTS), "grad.attn_context": (SEQ, BATCH, HIDDEN)}
    for r in records:
        key = (r.key.microbatch, r.key.layer, r.key.output)
        got = r.tensor()
        assert tuple(got.shape) == shapes.get(r.key.output, (SEQ, BATCH, HIDDEN)), key
        assert torch.equal(bits(got), bits(oracle.seen[key])), key
        assert (r.key.iteration, r.key.invocation, r.key.phase) == (3, 0, "train")
        assert (r.key.token_start, r.key.token_end, r.key.shard_count) == (0, got.shape[0], 1)
    assert capture.stats.replays_rejected == 0  # gradients are not replays


@pytest.mark.parametrize("recompute", ["full", "selective-core_attn"])
def test_recompute_records_the_bits_of_a_plain_run(megatron_cpu, recompute):
    """Recompute re-runs the same forward code, so the gradients it records equal, bitwise, those
    of the same model and data without recompute."""
    plain = {(r.key.microbatch, r.key.layer, r.key.output): r.payload for r in run(None)[0].transport.take(1000, 0)}
    recomputed = {
        (r.key.microbatch, r.key.layer, r.key.output): r.payload for r in run(recompute)[0].transport.take(1000, 0)
    }
    assert recomputed == plain


def test_backward_order_does_not_matter_without_recompute(megatron_cpu):
    """Each gradient carries the microbatch of its forward, whatever order the backwards run in."""
    capture, oracle = run(None, backward_order=(1, 0))
    records = capture.transport.take(1000, 0)
    assert len(records) == MICROBATCHES * 2 * len(OUTPUTS)
    for r in records:
        key = (r.key.microbatch, r.key.layer, r.key.output)
        assert torch.equal(bits(r.tensor()), bits(oracle.seen[key])), key


def test_recorded_replays_leave_gradients_recorded_once(megatron_cpu):
    """--dmi-record-replays keeps full recompute's forward replays as invocation 1; the gradients
    stay one record each, invocation 0."""
    torch.manual_seed(0)
    model = tiny_gpt(recompute=RECOMPUTE["full"])
    capture = capture_for("grad,resid.in", record_replays=True)
    HookSet(capture).attach(model)
    capture.begin_step("train", 1)
    pipelined_step(model, capture, GradientOracle(model), (0, 1))
    keys = sorted((r.key.output, r.key.invocation) for r in capture.transport.take(1000, 0))
    per_output = {k: keys.count(k) for k in set(keys)}
    assert per_output == {**{(o, 0): 4 for o in OUTPUTS}, ("resid.in", 0): 4, ("resid.in", 1): 4}


def test_evaluation_records_no_gradient(megatron_cpu):
    """An evaluation forward (eval mode, no grad) has no backward: nothing is recorded and nothing
    waits for a replay."""
    model = tiny_gpt()
    capture = capture_for("grad", phases=frozenset({"train", "valid"}))
    HookSet(capture).attach(model)
    model.eval()
    capture.begin_step("valid", 1)
    with torch.no_grad():
        model(*tokens(), attention_mask=None)
    assert capture.transport.take(100, 0) == []
    assert not any(capture._awaiting_replay.values())


def test_remove_restores_every_module_with_router_and_grad(megatron_cpu):
    """router and grad both wrap a router's routing step; removing the hooks drops both wrappers
    and every module hook: a training step afterwards records nothing."""
    model = tiny_gpt()
    capture = capture_for("router,grad")
    hooks = HookSet(capture)
    hooks.attach(model)
    hooks.remove()
    capture.begin_step("train", 1)
    ids, pos = tokens()
    model(ids, pos, attention_mask=None, labels=ids).sum().backward()
    assert capture.transport.pending() == 0
    assert all("routing" not in vars(m) for m in model.modules() if isinstance(m, TopKRouter))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_selection_by_iteration_and_layer(megatron_cpu):
    """--dmi-interval and --dmi-layers select gradients as they select forward outputs; an
    uncaptured step leaves nothing waiting for a replay."""
    torch.manual_seed(0)
    model = tiny_gpt(recompute=RECOMPUTE["full"])
    capture = capture_for("grad", interval=2, layers=frozenset({1}))
    HookSet(capture).attach(model)
    oracle = GradientOracle(model)
    for iteration in (1, 2):
        capture.begin_step("train", iteration)
        oracle.seen.clear()
        pipelined_step(model, capture, oracle, (0, 1))
        assert not any(capture._awaiting_replay.values())
    got = sorted({(r.key.iteration, r.key.layer) for r in capture.transport.take(1000, 0)})
    assert got == [(1, 1)]
