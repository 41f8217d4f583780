"""The reader's torch-free decode and rebuild (numpy) against torch's, for every dtype a store holds."""

import numpy as np
import pytest
import torch

from megatron.core.dmi.key import ITEM_SIZE
from megatron.core.dmi.reader.reconstruct import rebuild, reconstruct
from megatron.core.dmi.reader.store import token_entropy
from megatron.core.dmi.records import array_to_tensor, payload_to_array, payload_to_tensor, tensor_to_payload
from tests.unit_tests.dmi.sinks.workers import rec


def _sample(dtype: str) -> torch.Tensor:
    """[6, 4] of ``dtype`` with its edge values: NaNs with a sign and a payload, infinities, -0, subnormals,
    the extremes of integer types."""
    g = torch.Generator().manual_seed(5)
    t = getattr(torch, dtype)
    if dtype == "bool":
        return torch.rand(6, 4, generator=g) > 0.5
    if not t.is_floating_point:
        info = torch.iinfo(t)
        out = torch.randint(info.min, info.max, (6, 4), generator=g, dtype=torch.int64).to(t)
        out.view(-1)[:2] = torch.tensor([info.min, info.max])
        return out
    out = (torch.randn(6, 4, generator=g) * 100).to(t)
    info = torch.finfo(t)
    out.view(-1)[:6] = torch.tensor([float("nan"), float("-inf"), float("inf"), -0.0, info.tiny / 4, info.max]).to(t)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}.get(t, torch.int64)
    out.view(bits).view(-1)[6] = out.view(bits).view(-1)[0] | -(2 ** (8 * t.itemsize - 1)) | 1  # -NaN, payload 1
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN == NaN when their bits are)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


def test_every_stored_dtype_is_covered():
    assert set(ITEM_SIZE) == {"float32", "float64", "bfloat16", "float16", "int32", "int64", "uint8", "bool"}


@pytest.mark.parametrize("dtype", list(ITEM_SIZE))
def test_numpy_decode_equals_torch_decode_bitwise(dtype):
    t = _sample(dtype)
    payload = tensor_to_payload(t)
    by_torch = payload_to_tensor(payload, dtype, t.shape)
    values = payload_to_array(payload, dtype, t.shape)
    # the values: bfloat16 widened as torch widens it (exactly), every other dtype as torch reads it
    want = by_torch.float() if dtype == "bfloat16" else by_torch
    assert values.dtype == want.numpy().dtype and values.shape == tuple(t.shape)
    assert values.tobytes() == want.numpy().tobytes()
    # and back to torch: the stored bits, NaN payloads included
    back = array_to_tensor(values, dtype)
    assert back.dtype == t.dtype and torch.equal(_bits(back), _bits(t))


@pytest.mark.parametrize("dtype", list(ITEM_SIZE))
def test_rebuild_of_tensor_parallel_shards_equals_torch_bitwise(dtype):
    full = torch.cat([_sample(dtype), _sample(dtype).flip(0)]).reshape(12, 1, 4)
    recs = [
        rec("attn.context", part.contiguous(), rank=i, tp=i, shard_index=i, shard_count=2, token_total=12)
        for i, part in enumerate(full.chunk(2, dim=-1))
    ]
    got = rebuild(recs, "attn.context")
    assert got.dtype == dtype and got.shape == (12, 1, 4)
    assert torch.equal(_bits(got.torch()), _bits(full))
    assert torch.equal(_bits(reconstruct(recs, "attn.context")), _bits(full))


@pytest.mark.parametrize("dtype", ["int32", "int64", "float16", "bfloat16", "float32"])
def test_summed_token_shards_round_as_torch_adds_them(dtype):
    """``sum`` adds the shards one by one in the stored dtype, as torch does: float16 and bfloat16 round at
    every step (bfloat16, which numpy lacks, is added by torch)."""
    g = torch.Generator().manual_seed(2)
    parts = [(torch.randn(2, 8, generator=g) * 37).to(getattr(torch, dtype)) for _ in range(4)]
    recs = [
        rec("router.expert_counts", p, rank=i, token_start=8 * i, token_end=8 * (i + 1), token_total=32)
        for i, p in enumerate(parts)
    ]
    want = parts[0].clone()
    for p in parts[1:]:
        want += p
    got = rebuild(recs, "router.expert_counts")
    assert got.dtype == dtype and torch.equal(_bits(got.torch()), _bits(want))


def test_token_entropy_is_torchs_softmax_entropy_in_fp32():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 8, generator=g) * 3
    logits[0] = torch.tensor([-200.0, 0, 0, 0, 0, 0, 0, 0])  # exp underflows to 0: 0 log 0 = 0
    want = torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1)
    got = token_entropy(logits.numpy())
    assert got.dtype == np.float32
    # numpy's and torch's float32 exp/log differ by an ulp or two, and which way depends on the CPU's
    # vector units: a nearly certain token (entropy ~0.004) then differs by ~1e-7 absolute
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)
