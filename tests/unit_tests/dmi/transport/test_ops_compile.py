"""dmi::ring_capture custom op: torch.compile keeps every capture, once, in program order."""

import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import dtype_name
from megatron.core.dmi.transport import ops
from megatron.core.dmi.transport.native import NativeRingTransport
from tests.unit_tests.dmi.transport.ring import drain_all


def _key(t, output):
    return RecordKey(
        "run",
        "train",
        0,
        0,
        0,
        0,
        0,
        output,
        ParallelCoords(),
        0,
        1,
        0,
        t.shape[0],
        t.shape[0],
        dtype_name(t.dtype),
        tuple(t.shape),
    )


def test_compiled_function_records_every_capture_once_in_order():
    tr = NativeRingTransport(1 << 16, "drop", torch.device("cpu"), block_timeout=DMIConfig.block_timeout)
    x0 = torch.randn(8, 4)
    s_in = tr.register_site(_key(x0, "resid"))
    s_mid = tr.register_site(_key(x0, "mlp"))
    s_out = tr.register_site(_key(x0, "logits"))

    def f(x):
        ops.capture(tr, s_in, x)
        h = torch.relu(x * 2.0 + 1.0)
        ops.capture(tr, s_mid, h)
        y = h.sum(dim=1, keepdim=True) * h  # the capture of h must see h, not y
        ops.capture(tr, s_out, y)
        return y

    compiled = torch.compile(f, fullgraph=True)
    inputs = [torch.randn(8, 4) for _ in range(3)]
    expected = []
    for it, x in enumerate(inputs):
        tr.set_context(iteration=it + 1)
        y = compiled(x)
        h = torch.relu(x * 2.0 + 1.0)
        assert torch.allclose(y, h.sum(dim=1, keepdim=True) * h)
        expected += [("resid", it + 1, x), ("mlp", it + 1, h), ("logits", it + 1, y)]
    out = drain_all(tr)
    assert [(r.key.output, r.key.iteration) for r in out] == [(o, i) for o, i, _ in expected]
    for r, (_, _, t) in zip(out, expected):
        assert torch.allclose(r.tensor(), t, rtol=1e-6, atol=1e-6)
    assert tr.stats.published == 9 and tr.stats.dropped == 0
    tr.close()


def test_op_is_registered_with_a_mutated_ring_argument():
    schema = torch.ops.dmi.ring_capture.default._schema
    ring_arg = schema.arguments[0]
    assert ring_arg.name == "ring" and ring_arg.alias_info is not None and ring_arg.alias_info.is_write
    assert not schema.returns


def test_eager_op_call_publishes_under_the_gate():
    tr = NativeRingTransport(4096, "drop", torch.device("cpu"), block_timeout=DMIConfig.block_timeout)
    t = torch.arange(6, dtype=torch.int64)
    site = tr.register_site(_key(t, "router.topk_ids"))
    tr.set_gate(False)
    ops.capture(tr, site, t)
    tr.set_gate(True)
    ops.capture(tr, site, t + 1)
    (rec,) = drain_all(tr)
    assert torch.equal(rec.tensor(), t + 1) and tr.stats.rejected == 1
    tr.close()


def test_the_custom_op_passes_torch_library_opcheck():
    """Schema, fake (meta) implementation, autograd registration and the declared mutation of
    ``ring`` agree with what the op does (torch.library.opcheck's standard checks)."""
    tr = NativeRingTransport(1 << 16, "drop", torch.device("cpu"), block_timeout=DMIConfig.block_timeout)
    x = torch.randn(8, 4)
    site = tr.register_site(_key(x, "resid"))
    try:
        torch.library.opcheck(ops.ring_capture, (tr.ring_tensor, x, tr.handle, site, 1))
        assert drain_all(tr)  # opcheck ran the op for real: its records reached the ring
    finally:
        tr.close()
