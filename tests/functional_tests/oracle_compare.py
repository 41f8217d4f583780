"""Comparisons of DMI's rebuilt tensors with the in-run oracle (oracle_launch.py): bit for bit, and
the stored top-k selection against the routing megatron-core computed."""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaNs and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        bits = _BITS[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def topk_consistent(ids, probs, seen, experts=4) -> bool:
    """The stored top-k ids and weights (dropped routes: id ``experts``, weight 0) select exactly
    the oracle's routing map and carry its probabilities."""
    chosen = torch.zeros_like(seen["routing_map"])
    kept = ids < experts
    rows = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(ids)
    chosen[rows[kept], ids[kept].long()] = True
    return (
        torch.equal(chosen, seen["routing_map"])
        and torch.equal(probs[kept], seen["probs"][rows[kept], ids[kept].long()])
        and bool(torch.all(probs[~kept] == 0))
    )
