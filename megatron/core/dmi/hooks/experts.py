"""Per-expert outputs (``mlp.experts``): each row the routed experts of this rank computed, with the
rank and token it came from and its routing probability.

The allgather token dispatcher gathers the tokens of its TP x EP group (``tp_ep_group``) along dim 0,
in group-rank order, so row ``t`` of its ``local_map`` ([gathered tokens, local experts] bool, kept
from its dispatch until the next one) is token ``t % n`` of the group's ``t // n``-th rank, ``n``
tokens per rank. Its permutation puts the rows expert by expert, tokens ascending within an expert:
the row-major order of ``local_map.T``'s nonzeros. The experts receive each row's routing
probability (``permuted_probs``) in that order. A row's top-k slot depends on the token's experts on
every rank, so the reader derives it (``reader.reconstruct.rebuild_expert_rows``).
"""

from __future__ import annotations

import torch


def expert_rows(
    output: torch.Tensor,
    local_map: torch.Tensor,
    permuted_probs: torch.Tensor,
    first_expert: int,
    group_ranks: list[int],
) -> torch.Tensor:
    """The ``mlp.experts`` record of one forward: [rows, h + 5] fp32.

    Args:
        output: the experts' output, [rows, h], rows in the dispatcher's permuted order (a partial
            sum under expert tensor parallelism: the ETP ranks' rows add up to the row).
        local_map: the dispatcher's [gathered tokens, local experts] routing map of the same forward.
        permuted_probs: each row's routing probability, in row order (the experts' third argument).
        first_expert: global id of the first local expert.
        group_ranks: global ranks of the dispatcher's TP x EP group, in group order (the gather order).

    Returns:
        Columns 0..h-1 the rows (upcast exactly), then ``catalog.EXPERT_ROW_FIELDS``: the global expert id, the global
        rank whose token it is, the token's index among that rank's tokens, that rank's token count
        and the routing probability (fp32, exact for router dtypes up to fp32).
    """
    local_expert, token = local_map.t().nonzero(as_tuple=True)
    per_rank = local_map.shape[0] // len(group_ranks)
    ranks = torch.tensor(group_ranks, dtype=torch.long, device=local_map.device)
    fields = torch.stack(
        [
            (local_expert + first_expert).float(),
            ranks[token // per_rank].float(),
            (token % per_rank).float(),
            torch.full_like(token, per_rank).float(),
            permuted_probs.reshape(-1).float(),
        ],
        dim=1,
    )
    return torch.cat([output.float(), fields], dim=1)
