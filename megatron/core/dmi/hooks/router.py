"""Router capture: logits, top-k ids with dropped-route sentinels, top-k weights, expert counts.

TopKRouter.routing(logits) returns post-capacity-drop (probs, routing_map) as dense [tokens, E]
tensors. The pre-drop selection is seen by wrapping megatron-core's token-dropping function for
the duration of the wrapped ``routing`` call.
"""

from __future__ import annotations

import contextlib
import threading

import torch

import megatron.core.transformer.moe.router as mcore_router

_pre_drop = threading.local()
_original_token_dropping = mcore_router.apply_router_token_dropping


def _recording_token_dropping(routing_probs, routing_map, *args, **kwargs):
    _pre_drop.selection = (routing_probs, routing_map)
    return _original_token_dropping(routing_probs, routing_map, *args, **kwargs)


@contextlib.contextmanager
def pre_drop_visible():
    """Route megatron-core's capacity dropping through a recorder while DMI hooks are installed."""
    mcore_router.apply_router_token_dropping = _recording_token_dropping
    try:
        yield
    finally:
        mcore_router.apply_router_token_dropping = _original_token_dropping


def take_pre_drop() -> tuple[torch.Tensor, torch.Tensor] | None:
    sel = getattr(_pre_drop, "selection", None)
    _pre_drop.selection = None
    return sel


def topk_view(
    probs: torch.Tensor, routing_map: torch.Tensor, pre_probs: torch.Tensor, pre_map: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, k] expert ids (sentinel E where capacity dropped the route) and their weights.

    Slots are ordered by pre-drop probability, descending; a stable sort puts the lower expert id
    first on ties, so the order is fully determined by the router's own outputs.
    """
    num_experts = probs.shape[-1]
    score = pre_probs.float().masked_fill(~pre_map, float("-inf"))
    ids = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :topk]
    kept = routing_map.gather(1, ids)
    weights = probs.gather(1, ids) * kept
    ids = torch.where(kept, ids, torch.full_like(ids, num_experts))
    return ids.to(torch.int32), weights


def expert_counts(routing_map: torch.Tensor, pre_map: torch.Tensor) -> torch.Tensor:
    """[2, E]: tokens per expert before (row 0) and after (row 1) capacity dropping."""
    return torch.stack([pre_map.sum(0), routing_map.sum(0)]).to(torch.int32)
