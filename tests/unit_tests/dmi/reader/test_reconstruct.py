"""Reconstruction from hand-built shard sets (no store needed)."""

import pytest
import torch

from megatron.core.dmi.reader import ReconstructionError
from megatron.core.dmi.reader.reconstruct import reconstruct
from megatron.core.dmi.records import Record
from tests.unit_tests.dmi.sinks.workers import make_key, rec


def shards_context(full: torch.Tensor, tp: int, cp: int):
    """attn.context [s, b, h*d] split by CP over s and by TP over the last dim."""
    s = full.shape[0]
    out = []
    for c in range(cp):
        lo, hi = c * s // cp, (c + 1) * s // cp
        for t, part in enumerate(full[lo:hi].chunk(tp, dim=-1)):
            out.append(
                rec(
                    "attn.context",
                    part.contiguous(),
                    rank=c * tp + t,
                    tp=t,
                    cp=c,
                    shard_index=t,
                    shard_count=tp,
                    token_start=lo,
                    token_end=hi,
                    token_total=s,
                )
            )
    return out


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 3)])
def test_concat_tp_cp(tp, cp):
    full = torch.randn(12, 2, 8).to(torch.bfloat16)
    recs = shards_context(full, tp, cp)
    got = reconstruct(list(reversed(recs)), "attn.context")
    assert torch.equal(got.view(torch.int16), full.view(torch.int16))


def test_q_shards_on_head_dim():
    q = torch.randn(6, 1, 4, 3)
    recs = [
        rec("attn.q", p.contiguous(), rank=i, tp=i, shard_index=i, shard_count=2, token_total=6)
        for i, p in enumerate(q.chunk(2, dim=2))
    ]
    assert torch.equal(reconstruct(recs, "attn.q"), q)


def test_identical_duplicates_from_replicas_are_fine():
    logits = torch.randn(8, 4)
    recs = [rec("router.logits", logits, rank=r, tp=r) for r in range(4)]
    assert torch.equal(reconstruct(recs), logits)


def test_conflicting_duplicates():
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(ReconstructionError, match=r"conflicting duplicates .*tokens \[0, 8\).*rank 0.*rank 1"):
        reconstruct([rec("router.logits", a, rank=0), rec("router.logits", b, rank=1)])


def test_gap_names_missing_token_range():
    full = torch.randn(12, 4)
    recs = [
        rec("router.logits", full[0:4].contiguous(), rank=0, token_start=0, token_end=4, token_total=12),
        rec("router.logits", full[8:12].contiguous(), rank=2, token_start=8, token_end=12, token_total=12),
    ]
    with pytest.raises(ReconstructionError, match=r"gap: tokens \[4, 8\) of 12 are missing"):
        reconstruct(recs)
    with pytest.raises(ReconstructionError, match=r"gap: tokens \[4, 12\) of 12"):
        reconstruct(recs[:1])


def test_overlap():
    full = torch.randn(12, 4)
    recs = [
        rec("router.logits", full[0:8].contiguous(), rank=0, token_start=0, token_end=8, token_total=12),
        rec("router.logits", full[6:12].contiguous(), rank=1, token_start=6, token_end=12, token_total=12),
    ]
    with pytest.raises(
        ReconstructionError, match=r"overlapping token ranges \[0, 8\) \(rank\(s\) 0\) and \[6, 12\) \(rank\(s\) 1\)"
    ):
        reconstruct(recs)


def test_missing_shard_names_shard_and_expected_rank():
    full = torch.randn(4, 1, 8)
    recs = shards_context(full, 4, 1)
    del recs[2]
    with pytest.raises(ReconstructionError, match=r"shard\(s\) \[2\] of 4 missing.*expected from rank\(s\) 6"):
        reconstruct(recs, expected_ranks={0: [4], 1: [5], 2: [6], 3: [7]})


def test_sum_over_token_shards_and_replicas():
    a = torch.tensor([[3, 1, 0, 4], [3, 1, 0, 3]], dtype=torch.int32)
    b = torch.tensor([[1, 1, 2, 4], [1, 0, 2, 4]], dtype=torch.int32)
    recs = [
        rec("router.expert_counts", a, rank=0, token_start=0, token_end=4, token_total=8),
        rec("router.expert_counts", a, rank=2, token_start=0, token_end=4, token_total=8),  # replica
        rec("router.expert_counts", b, rank=1, token_start=4, token_end=8, token_total=8),
    ]
    assert torch.equal(reconstruct(recs), a + b)
    with pytest.raises(ReconstructionError, match="gap"):
        reconstruct(recs[:2])


def test_zero_rows_and_bad_sizes():
    z = torch.empty(0, 4)
    assert reconstruct([rec("router.logits", z)]).shape == (0, 4)
    r = rec("router.logits", torch.randn(4, 4))
    with pytest.raises(ReconstructionError, match="bytes"):
        reconstruct([Record(r.key, r.payload[:-1])])
    k = make_key("router.logits", torch.randn(4, 4), token_end=3)
    with pytest.raises(ReconstructionError, match="rows"):
        reconstruct([Record(k, r.payload)])
    with pytest.raises(ReconstructionError, match="disagree on dtype"):
        reconstruct(
            [
                rec("router.logits", torch.randn(2, 4), token_end=2, token_total=4),
                rec("router.logits", torch.randn(2, 4).half(), token_start=2, token_end=4, token_total=4),
            ]
        )
