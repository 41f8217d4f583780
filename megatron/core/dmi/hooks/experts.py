"""Per-expert outputs (``mlp.experts``): each row the routed experts computed, with the token and
top-k slot it belongs to.

The allgather token dispatcher keeps ``local_map`` ([tokens, local experts] bool, post-drop) from
its dispatch until the next one; its permutation puts the rows expert by expert, tokens ascending
within an expert, which is the row-major order of ``local_map.T``'s nonzeros. The experts receive
each row's routing probability (``permuted_probs``) in that order, so the rows, their token indices
and their slots all follow from what the experts module sees and that map.
"""

from __future__ import annotations

import torch


def expert_rows(
    output: torch.Tensor, local_map: torch.Tensor, permuted_probs: torch.Tensor, first_expert: int, topk: int
) -> torch.Tensor:
    """The ``mlp.experts`` record of one forward: [rows, h + 3] fp32.

    Args:
        output: the experts' output, [rows, h], rows in the dispatcher's permuted order.
        local_map: the dispatcher's [tokens, local experts] routing map of the same forward.
        permuted_probs: each row's routing probability, in row order (the experts' third argument).
        first_expert: global id of the first local expert.
        topk: ``--moe-router-topk``.

    Returns:
        Columns 0..h-1 the rows (upcast exactly), then expert id, token index and top-k slot.
    """
    local_expert, token = local_map.t().nonzero(as_tuple=True)
    probs = torch.zeros(local_map.shape, dtype=torch.float32, device=local_map.device)
    probs[token, local_expert] = permuted_probs.reshape(-1).float()
    # Slots in router.topk_ids' order: probability descending, the lower expert id first on ties.
    score = probs.masked_fill(~local_map, float("-inf"))
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :topk]
    slot_of = torch.full(local_map.shape, -1, dtype=torch.long, device=local_map.device)
    slot_of.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    fields = torch.stack([local_expert + first_expert, token, slot_of[token, local_expert]], dim=1)
    return torch.cat([output.float(), fields.float()], dim=1)
