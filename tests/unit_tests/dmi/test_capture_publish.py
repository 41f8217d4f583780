"""HookSite.publish (through Capture.publish_records): the outputs of one hook firing go to the
transport in one call, each under its own site with the step's fields; what the ring drops is
reported key by key."""

import torch

from megatron.core.dmi.capture import Capture
from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.hooks.groups.base import HookSite, Shards
from megatron.core.dmi.key import ParallelCoords
from megatron.core.dmi.transport.abi import SLOT_ALIGN
from megatron.core.dmi.transport.torch_ring import TorchRingTransport

OUTPUTS = {  # one router firing: 16 tokens, 4 experts, top-2 (each output fits one 256-byte slot)
    "router.logits": torch.arange(64, dtype=torch.float32).reshape(16, 4),
    "router.topk_ids": torch.arange(32, dtype=torch.int32).reshape(16, 2),
    "router.topk_probs": torch.full((16, 2), 0.5),
    "router.expert_counts": torch.tensor([[8, 8, 8, 8], [8, 8, 7, 8]], dtype=torch.int32),
}


def firing_capture(slots: int) -> Capture:
    config = DMIConfig(hooks=parse_hooks("router"))
    capture = Capture(
        config,
        TorchRingTransport(slots * SLOT_ALIGN, "drop", torch.device("cpu"), block_timeout=DMIConfig.block_timeout),
        "run-a",
        3,
    )
    capture.begin_step("train", 7)
    capture.set_microbatch(2)
    return capture


def test_a_firings_outputs_arrive_in_order_with_their_keys_and_bytes():
    capture = firing_capture(slots=8)
    coords = ParallelCoords(rank=1, tp=1, ep=1)
    # tensor-parallel rank 1 of 4 under sequence parallelism: this rank's 16 tokens are 16..32 of 64
    site = HookSite(capture, 5, Shards(coords, tp=4, sequence_parallel=True), tuple(OUTPUTS))
    assert site.publish(16, list(OUTPUTS.values())) == 4
    records = capture.transport.take(10, 0)
    assert [r.key.output for r in records] == list(OUTPUTS)
    for r in records:
        k = r.key
        assert (k.run_id, k.phase, k.iteration, k.attempt, k.microbatch, k.invocation) == ("run-a", "train", 7, 3, 2, 0)
        assert (k.layer, k.coords, k.token_start, k.token_end, k.token_total) == (5, coords, 16, 32, 64)
        assert torch.equal(r.tensor(), OUTPUTS[k.output])
    # a second firing of the same site reuses its keys with the new step fields
    capture.set_microbatch(3)
    site.publish(16, list(OUTPUTS.values()))
    again = capture.transport.take(10, 0)
    assert [r.key for r in again] == [r.key.fired(r.key.firing._replace(microbatch=3)) for r in records]


def test_what_the_ring_drops_is_reported_key_by_key():
    capture = firing_capture(slots=2)
    site = HookSite(capture, 0, Shards(ParallelCoords(), tp=1, sequence_parallel=False), tuple(OUTPUTS))
    accepted = site.publish(16, list(OUTPUTS.values()))
    assert accepted == 2 and capture.transport.stats.dropped == 2
    dropped = capture.stats.dropped_keys
    assert [k.output for k in dropped] == ["router.topk_probs", "router.expert_counts"]
    assert all((k.iteration, k.microbatch, k.attempt) == (7, 2, 3) for k in dropped)
    assert [r.key.output for r in capture.transport.take(10, 0)] == ["router.logits", "router.topk_ids"]
