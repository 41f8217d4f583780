"""Native ring, CUDA build, on a real GPU: bitwise oracles, backpressure, CUDA-graph replays with the
device gate, JIT build times and drain throughput (printed; JSON to $DMI_RESULTS_DIR if set).

Run: tests/gpu/run_native_gpu.sh (or PYTHONPATH=. python -m pytest tests/gpu -q -s).
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Build into a fresh extensions folder so the first build of this run is a cold one.
_EXT_DIR = os.environ.setdefault("TORCH_EXTENSIONS_DIR", tempfile.mkdtemp(prefix="dmi_ext_"))
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

from megatron.core.dmi.config import DMIConfig  # noqa: E402
from megatron.core.dmi.key import Firing, ParallelCoords, RecordKey  # noqa: E402
from megatron.core.dmi.records import dtype_name  # noqa: E402
from megatron.core.dmi.transport import jit, ops  # noqa: E402
from megatron.core.dmi.transport.abi import SLOT_ALIGN  # noqa: E402
from megatron.core.dmi.transport.native import NativeRingTransport  # noqa: E402
from tests.unit_tests.dmi.transport.ring import drain_all, ring_state  # noqa: E402

RESULTS: dict = {}


def _save(name, data):
    RESULTS[name] = data
    print(f"\n[dmi-gpu] {name}: {json.dumps(data)}")
    out = os.environ.get("DMI_RESULTS_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=2))


def cuda_ring(
    ring_bytes: int, on_full: str = "block", staging_bytes: int | None = None, block_timeout: float | None = None
):
    """A native ring on the GPU (staging sized by the transport unless given; the default block timeout)."""
    timeout = DMIConfig.block_timeout if block_timeout is None else block_timeout
    return NativeRingTransport(
        ring_bytes, on_full, torch.device("cuda"), block_timeout=timeout, staging_bytes=staging_bytes
    )


def key_for(t, iteration=1, output="router.logits", layer=0):
    rows = t.shape[0] if t.dim() else 1
    return RecordKey(
        "run",
        "train",
        iteration,
        0,
        0,
        0,
        layer,
        output,
        ParallelCoords(),
        0,
        1,
        0,
        rows,
        rows,
        dtype_name(t.dtype),
        tuple(t.shape),
    )


def random_bits(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cuda")
    bits = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    return bits.view(dtype).reshape(shape)


def _load_in_subprocess(ext_dir):
    code = (
        "import time,json; t=time.perf_counter(); from megatron.core.dmi.transport import jit; "
        "jit.load_cuda(); jit.load_host(); print(json.dumps({'seconds': time.perf_counter()-t, "
        "'timings': jit.build_timings()}))"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=ext_dir)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_jit_build_cold_and_cached():
    cold = _load_in_subprocess(_EXT_DIR)
    cached = _load_in_subprocess(_EXT_DIR)
    data = {
        "cold_seconds": cold["seconds"],
        "cold_cuda_build_seconds": cold["timings"]["cuda"]["seconds"],
        "cold_host_build_seconds": cold["timings"]["host"]["seconds"],
        "cold_was_cached": cold["timings"]["cuda"]["cached"],
        "cached_seconds": cached["seconds"],
        "cached_cuda_load_seconds": cached["timings"]["cuda"]["seconds"],
        "cached_host_load_seconds": cached["timings"]["host"]["seconds"],
        "report": jit.build_report(),
    }
    _save("native_jit_build", data)
    assert cached["timings"]["cuda"]["cached"]  # its load time is recorded above, a benchmark figure


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])
def test_bitwise_round_trip_against_synchronous_copy(dtype):
    tr = cuda_ring(64 << 20)
    shapes = [(0, 8), (1, 8), (7, 3), (4096, 16), (1 << 20, 3)]
    tensors = [random_bits(s, dtype, i) for i, s in enumerate(shapes)]
    big = random_bits((1025, 3), dtype, 99)
    tensors.append(big[1:])  # offset view: source not 16-byte aligned
    tensors.append(random_bits((64, 32), dtype, 7).t())  # non-contiguous
    oracles = [t.contiguous().cpu() for t in tensors]  # independent synchronous path
    for i, t in enumerate(tensors):
        assert tr.publish(key_for(t, iteration=i), t)
    out = drain_all(tr, 30)
    assert [r.key.iteration for r in out] == list(range(len(tensors)))
    for r, o in zip(out, oracles):
        got = r.tensor()
        assert got.shape == o.shape and got.dtype == o.dtype
        if o.numel():
            assert torch.equal(got.view(torch.uint8), o.view(torch.uint8))
        else:
            assert r.payload == b""
    assert tr.stats.published == len(tensors) and tr.stats.dropped == 0
    tr.close()


def test_drop_mode_counts_exactly_and_wraps():
    tr = cuda_ring(4 * SLOT_ALIGN, "drop", staging_bytes=4 * SLOT_ALIGN)
    t = [torch.full((64,), float(i), device="cuda") for i in range(12)]
    for i in range(4):
        tr.publish(key_for(t[i], i), t[i])
    tr.sync_drain()
    for i in range(4, 8):
        tr.publish(key_for(t[i], i), t[i])
    tr.sync_drain()
    for i in range(8, 10):
        tr.publish(key_for(t[i], i), t[i])  # ring and staging full: dropped on the device
    z = torch.empty((0, 4), device="cuda")
    tr.publish(key_for(z, 50), z)  # zero bytes: still published
    torch.cuda.synchronize()
    s = tr.stats
    assert (s.published, s.dropped, s.dropped_bytes) == (9, 2, 512)
    out = drain_all(tr, 10)
    assert [r.key.iteration for r in out] == [0, 1, 2, 3, 4, 5, 6, 7, 50]
    for i in range(10, 12):  # space again, wrapping round the ring
        tr.publish(key_for(t[i], i), t[i])
    out = drain_all(tr, 10)
    assert [r.key.iteration for r in out] == [10, 11]
    assert all(torch.equal(r.tensor(), t[r.key.iteration].cpu()) for r in out)
    tr.close()


def test_group_publish_round_trip_in_order_with_its_own_firings():
    """publish_firings: up to 8 records per pair of launches (10 here: a group of 8, then 2),
    each with its own site and step fields, bitwise like a synchronous copy."""
    tr = cuda_ring(64 << 20)
    dtypes = [torch.float32, torch.bfloat16, torch.int32, torch.float16, torch.int64]
    tensors = [random_bits((37 * i + 1, 5), dtypes[i % 5], 100 + i) for i in range(8)]
    tensors.append(torch.empty((0, 3), device="cuda"))  # zero bytes
    tensors.append(random_bits((1 << 18, 3), torch.float32, 7)[1:].t())  # large, unaligned, non-contiguous
    oracles = [t.contiguous().cpu() for t in tensors]
    sites = [key_for(t, output="router.logits", layer=i).site() for i, t in enumerate(tensors)]
    handles = [tr.site_handle(s) for s in sites]
    firings = [Firing(5, i % 3, 0, "train", i % 2) for i in range(len(tensors))]
    assert tr.publish_firings(handles, tensors, firings) == [True] * len(tensors)
    out = drain_all(tr, 30)
    assert [r.key for r in out] == [s.fired(f) for s, f in zip(sites, firings)]
    for r, o in zip(out, oracles):
        assert torch.equal(r.tensor().view(torch.uint8), o.view(torch.uint8)) if o.numel() else r.payload == b""
    assert tr.stats.published == len(tensors) and tr.stats.dropped == 0
    tr.close()


def test_group_publish_drops_exactly_what_does_not_fit():
    tr = cuda_ring(4 * SLOT_ALIGN, "drop", staging_bytes=4 * SLOT_ALIGN)
    t = [torch.full((64,), float(i), device="cuda") for i in range(6)]  # one slot each
    handles = [tr.site_handle(key_for(x, layer=i).site()) for i, x in enumerate(t)]
    tr.publish_firings(handles, t, [Firing(i, 0, 0, "train", 0) for i in range(6)])
    torch.cuda.synchronize()
    s = tr.stats
    assert (s.published, s.dropped, s.dropped_bytes) == (4, 2, 512)
    out = drain_all(tr, 10)
    assert [r.key.iteration for r in out] == [0, 1, 2, 3]  # reserved in order: the first four fit
    assert all(torch.equal(r.tensor(), t[r.key.iteration].cpu()) for r in out)
    tr.close()


def test_block_mode_with_a_slow_consumer_loses_nothing():
    tr = cuda_ring(2 * SLOT_ALIGN, "block", staging_bytes=2 * SLOT_ALIGN)
    n = 200
    got = []

    def consume():
        while len(got) < n:
            got.extend(tr.take(3, 1.0))

    th = threading.Thread(target=consume)
    th.start()
    src = [torch.full((64,), float(i), device="cuda") for i in range(n)]
    for i in range(n):
        tr.publish(key_for(src[i], i), src[i])
    torch.cuda.synchronize()
    th.join(60)
    assert [r.key.iteration for r in got] == list(range(n))
    assert all(torch.equal(r.tensor(), src[i].cpu()) for i, r in enumerate(got))
    assert tr.stats.dropped == 0
    tr.close()


def test_block_mode_times_out_instead_of_hanging():
    tr = cuda_ring(SLOT_ALIGN, staging_bytes=SLOT_ALIGN, block_timeout=0.5)
    t = torch.ones(64, device="cuda")
    for i in range(3):  # staging 1, ring 1, third waits then gives up
        tr.publish(key_for(t, i), t)
        if i < 2:
            tr.sync_drain()
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    waited = time.perf_counter() - t0
    st = ring_state(tr)
    assert st["timeouts"] == 1 and tr.stats.dropped == 1 and 0.3 < waited < 10
    assert [r.key.iteration for r in drain_all(tr, 5)] == [0, 1]
    tr.close()


def test_cuda_graph_replays_with_gate_and_context():
    tr = cuda_ring(16 << 20)
    x = torch.zeros(256, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(256, 2, device="cuda", dtype=torch.int32)
    s_x = tr.register_site(key_for(x, output="attn.context", layer=3))
    s_h = tr.register_site(key_for(x, output="mlp", layer=3))
    s_ids = tr.register_site(key_for(ids, output="router.topk_ids", layer=3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (gate closed: publishes nothing)
        tr.set_gate(False)
        h = x * 2 + 1
        ops.capture(tr, s_x, x)
        ops.capture(tr, s_h, h)
        ops.capture(tr, s_ids, ids)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    warm_rejected = tr.stats.rejected
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        h = x * 2 + 1
        ops.capture(tr, s_x, x)
        ops.capture(tr, s_h, h)
        tr.publish_site(s_ids, ids)
    torch.cuda.synchronize()
    assert tr.stats.published == 0  # capture itself publishes nothing
    expected = []
    for rep in range(10):
        x.copy_(torch.randn(256, 64, device="cuda").to(torch.bfloat16))
        ids.copy_(torch.randint(0, 64, (256, 2), device="cuda", dtype=torch.int32))
        tr.set_context(iteration=rep + 1, microbatch=rep % 2)
        tr.set_gate(rep % 2 == 0)
        g.replay()
        if rep % 2 == 0:
            expected.append((rep + 1, x.cpu(), (x * 2 + 1).cpu(), ids.cpu()))
        torch.cuda.synchronize()
    torch.cuda.synchronize()
    s = tr.stats
    assert s.published == 15 and s.rejected - warm_rejected == 15 and s.dropped == 0
    out = drain_all(tr, 10)
    assert len(out) == 15
    for i, (it, xo, ho, io) in enumerate(expected):
        a, b, c = out[3 * i : 3 * i + 3]
        assert [r.key.output for r in (a, b, c)] == ["attn.context", "mlp", "router.topk_ids"]
        assert all(r.key.iteration == it and r.key.microbatch == (it - 1) % 2 for r in (a, b, c))
        assert torch.equal(a.tensor().view(torch.int16), xo.view(torch.int16))
        assert torch.equal(b.tensor().view(torch.int16), ho.view(torch.int16))
        assert torch.equal(c.tensor(), io)
    _save("native_graph_replays", {"replays": 10, "published": s.published, "rejected": s.rejected - warm_rejected})
    tr.close()


def test_drain_throughput():
    ring_mb, rec_mb, n = 512, 32, 48
    tr = cuda_ring(ring_mb << 20)
    src = torch.randint(0, 255, (rec_mb << 20,), dtype=torch.uint8, device="cuda")
    site = tr.register_site(key_for(src))
    got = [0]

    def consume():
        while got[0] < n:
            got[0] += len(tr.take(64, 1.0))

    th = threading.Thread(target=consume)
    for _ in range(2):  # warm-up
        tr.publish_site(site, src)
    torch.cuda.synchronize()
    drain_all(tr, 30)
    # device -> pinned staging only (copy engine), no Python consumer in the way: 12 x 32 MB fits staging
    k = 12
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(k):
        tr.publish_site(site, src)
    tr.sync_drain(60)
    t_drain = time.perf_counter() - t0
    drain_gbps = k * (rec_mb << 20) / 1e9 / t_drain
    drain_all(tr, 60)
    th.start()
    t0 = time.perf_counter()
    for _ in range(n):
        tr.publish_site(site, src)
    torch.cuda.synchronize()
    t_pub = time.perf_counter() - t0
    th.join(120)
    dt = time.perf_counter() - t0
    gb = n * (rec_mb << 20) / 1e9
    st = ring_state(tr)
    data = {
        "records": n,
        "record_mb": rec_mb,
        "ring_mb": ring_mb,
        "seconds": dt,
        "GBps_end_to_end": gb / dt,
        "GBps_device_to_staging": drain_gbps,
        "producer_seconds": t_pub,
        "drain_batches": st["drain_batches"],
        "drain_copies": st["drain_copies"],
    }
    _save("native_drain_throughput", data)
    assert got[0] == n and tr.stats.dropped == 0
    tr.close()


def test_the_cuda_build_reads_every_code_as_the_host_build_does():
    """Both builds refuse an unknown on_full, take exactly one firing's context words, and export
    the same constants (checked against abi.py at load)."""
    from megatron.core.dmi.transport import abi
    from megatron.core.dmi.transport.base import TransportInputError

    mod = jit.load_cuda()
    assert {name: getattr(mod, name) for name in abi.EXPECTED} == {
        name: getattr(jit.load_host(), name) for name in abi.EXPECTED
    }
    with pytest.raises(TransportInputError, match="on_full code 7"):
        mod.CudaRing(torch.cuda.current_device(), 1 << 12, 64, 1 << 12, 7, 1.0)
    ring = mod.CudaRing(torch.cuda.current_device(), 1 << 12, 64, 1 << 12, abi.ON_FULL["drop"], 1.0)
    stream = torch.cuda.current_stream().cuda_stream
    try:
        with pytest.raises(TransportInputError, match=f"{abi.FIRING_WORDS} context words"):
            ring.publish(0, 0, 0, 1, stream, [1, 2, 3])
        with pytest.raises(TransportInputError, match="publish_group"):
            ring.publish_group([0, 0], [0, 0], [0, 0], 1, [0] * abi.FIRING_WORDS, stream)
    finally:
        ring.close()
