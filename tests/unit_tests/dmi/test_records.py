import pytest
import torch

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import (
    DTYPE_BY_NAME,
    Record,
    UnsupportedDtypeError,
    dtype_name,
    records_to_table,
    tensor_to_payload,
)
from tests.unit_tests.dmi.tables import table_to_records


def key_for(t: torch.Tensor, **over) -> RecordKey:
    base = dict(
        run_id="r",
        phase="train",
        iteration=3,
        attempt=1,
        microbatch=2,
        invocation=0,
        layer=5,
        output="router.logits",
        coords=ParallelCoords(rank=3, tp=1, ep=1),
        shard_index=0,
        shard_count=1,
        token_start=0,
        token_end=t.shape[0] if t.dim() else 1,
        token_total=t.shape[0] if t.dim() else 1,
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
    )
    base.update(over)
    return RecordKey(**base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_payload_round_trip_is_bitwise(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    t = (torch.randn(rows, 5, generator=g) * 1000).to(dtype)
    rec = Record(key_for(t), tensor_to_payload(t))
    assert len(rec.payload) == rec.key.nbytes
    back = table_to_records(records_to_table([rec]))[0]
    assert back.key == rec.key
    out = back.tensor()
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8) if rows else out, t.view(torch.uint8) if rows else t)


def test_non_contiguous_tensor_is_captured_in_logical_order():
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    rec = Record(key_for(t), tensor_to_payload(t))
    assert torch.equal(rec.tensor(), t)


def test_unsupported_dtype_is_named():
    with pytest.raises(UnsupportedDtypeError, match=r"complex64 \(it records .*bfloat16"):
        dtype_name(torch.complex64)
    assert issubclass(UnsupportedDtypeError, (DMIError, TypeError))


def test_every_dtype_name_round_trips():
    for name, dtype in DTYPE_BY_NAME.items():
        assert dtype_name(dtype) == name
