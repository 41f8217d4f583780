"""Activation recomputation: a hook inside a recomputed region fires again during backward.
DMI records the original forward once; with record_replays it keeps the replay as invocation 1,
bitwise equal to the original."""

import pytest
import torch
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput, checkpoint

from megatron.core.dmi.hooks import HookSet
from megatron.core.dmi.hooks.groups.base import HookSite, Shards
from megatron.core.dmi.key import ParallelCoords
from tests.unit_tests.dmi.hooks.model_fixtures import capture_for, tiny_gpt, tokens

RECOMPUTE = {
    "selective-core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def train_step(model, microbatches=2):
    for mb in range(microbatches):
        model.capture.set_microbatch(mb)
        ids, pos = tokens(mb)
        model(ids, pos, attention_mask=None, labels=ids).sum().backward()


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("record_replays", [False, True])
def test_replays_rejected_or_kept_as_invocation_1(megatron_cpu, recompute, record_replays):
    model = tiny_gpt(recompute=RECOMPUTE[recompute])
    hooks = "attn" if recompute != "full" else "attn,router.topk_ids"
    capture = capture_for(hooks, record_replays=record_replays)
    HookSet(capture).attach(model)
    model.capture = capture
    capture.begin_step("train", 1)
    train_step(model)
    records = capture.transport.take(1000, 0)
    outputs = 1 if recompute != "full" else 2
    originals = [r for r in records if r.key.invocation == 0]
    replays = [r for r in records if r.key.invocation == 1]
    assert len(originals) == 2 * 2 * outputs  # microbatches x layers x outputs
    if not record_replays:
        assert replays == [] and capture.stats.replays_rejected == len(originals)
        return
    assert len(replays) == len(originals)
    by_key = {(r.key.microbatch, r.key.layer, r.key.output): r for r in originals}
    for r in replays:
        o = by_key[(r.key.microbatch, r.key.layer, r.key.output)]
        assert r.payload == o.payload  # the replay recomputes the same values, bitwise


def attn_context_site(capture, layer: int) -> HookSite:
    """The site a hook on a module standing in for core attention publishes through (one rank, no parallelism)."""
    return HookSite(capture, layer, Shards(ParallelCoords(), tp=1, sequence_parallel=False), ("attn.context",))


class Scaled(torch.nn.Module):
    """Stands in for a module recomputed through CheckpointWithoutOutput (moe_act, layernorm)."""

    def forward(self, x):
        return torch.nn.functional.gelu(x) * 3


@pytest.mark.parametrize("record_replays", [False, True])
@pytest.mark.parametrize("kind", ["CheckpointFunction", "CheckpointWithoutOutput"])
def test_module_level_checkpoints(megatron_cpu, kind, record_replays):
    capture = capture_for("attn.context", record_replays=record_replays)
    capture.begin_step("train", 1)
    module = Scaled()
    site = attn_context_site(capture, layer=0)

    def hook(m, args, out):
        site.publish(out.shape[0], (out.detach(),))

    module.register_forward_hook(hook)
    x = torch.randn(4, 3, requires_grad=True)
    if kind == "CheckpointFunction":
        y = checkpoint(module, False, x)
        (y * 2).sum().backward()
    else:
        ckpt = CheckpointWithoutOutput(fp8=None)  # 0.17.1 treats fp8=False as "fp8 on" (needs TE)
        y = ckpt.checkpoint(module, x)
        z = y * 2
        ckpt.discard_output_and_register_recompute(z)
        z.sum().backward()
    records = capture.transport.take(10, 0)
    assert [r.key.invocation for r in records] == ([0, 1] if record_replays else [0])
    if record_replays:
        assert records[0].payload == records[1].payload


def test_a_replay_without_its_original_forward_is_named(megatron_cpu):
    """A firing inside backward is a recompute replay; with record_replays it needs the original
    forward's microbatch, and one never recorded is an error naming the output and layer."""
    from megatron.core.dmi.capture import ReplayWithoutOriginalError
    from megatron.core.dmi.errors import DMIError

    capture = capture_for("attn.context", record_replays=True)
    capture.begin_step("train", 1)
    site = attn_context_site(capture, layer=3)
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 2

    def publish_in_backward(grad):
        site.publish(grad.shape[0], (grad.detach(),))

    y.register_hook(publish_in_backward)
    with pytest.raises(ReplayWithoutOriginalError, match="replay of attn.context layer 3 without a recorded original"):
        y.sum().backward()
    assert issubclass(ReplayWithoutOriginalError, DMIError)
