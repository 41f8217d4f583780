"""The fused router-selection kernel (csrc/dmi/router_select.cu) on a real GPU: bit for bit the torch
reference (hooks/groups/router.py topk_view + expert_counts) for every dtype, ties, capacity drops and odd
values, and what it saves on the host (printed; JSON to $DMI_RESULTS_DIR if set).

Run: tests/gpu/run_native_gpu.sh (or PYTHONPATH=. python -m pytest tests/gpu -q -s).
"""

import json
import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

from megatron.core.dmi.hooks.groups import router as rc  # noqa: E402
from megatron.core.dmi.transport import jit  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    return jit.load_cuda()


def routing_case(tokens, experts, k, dtype, seed, drop_share=0.0, ties=False):
    """Pre-drop top-k selection and a post-drop map/probabilities shaped like megatron-core's."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    if ties:
        logits = (logits * 2).round() / 2  # few distinct values: many equal scores per row
    pre_probs = torch.softmax(logits, -1).to(dtype)
    chosen = torch.topk(pre_probs.float(), k, dim=-1).indices
    pre_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter_(1, chosen, True)
    dropped = torch.rand(tokens, experts, generator=g, device="cuda") < drop_share
    routing_map = pre_map & ~dropped
    probs = pre_probs * routing_map
    return probs, routing_map, pre_probs, pre_map


def reference(probs, routing_map, pre_probs, pre_map, k):
    ids, weights = rc.topk_view(probs, routing_map, pre_probs, pre_map, k)
    return ids, weights, rc.expert_counts(routing_map, pre_map)


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        g, w = g.cpu().contiguous(), w.cpu().contiguous()
        if g.is_floating_point():
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "tokens,experts,k",
    [(0, 8, 2), (1, 4, 1), (1000, 16, 4), (8192, 16, 4), (4096, 64, 8), (2048, 256, 8), (257, 128, 32)],
)
@pytest.mark.parametrize("drop_share,ties", [(0.0, False), (0.3, True)])
def test_kernel_equals_reference_bitwise(kernels, dtype, tokens, experts, k, drop_share, ties):
    case = routing_case(tokens, experts, k, dtype, seed=tokens * 31 + experts, drop_share=drop_share, ties=ties)
    assert rc._kernel_takes(kernels, *case, k)
    got = rc._select_on_device(kernels, *case, k)
    assert_same_bits(got, reference(*case, k))  # the reference on the GPU
    assert_same_bits(got, reference(*(t.cpu() for t in case), k))  # and on the CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_capacity_dropping_the_pre_drop_pair_is_the_post_drop_pair(kernels, dtype):
    """The router's usual call: no capacity factor, so its wrapper hands the same two tensors twice
    (the kernel path then checks and copies them once)."""
    probs, routing_map, _, _ = routing_case(1000, 16, 4, dtype, seed=3)
    case = (probs, routing_map, probs, routing_map)
    assert rc._kernel_takes(kernels, *case, 4)
    assert_same_bits(rc._select_on_device(kernels, *case, 4), reference(*case, 4))
    assert_same_bits(rc.select(*case, 4), reference(*(t.cpu() for t in case), 4))


def test_odd_values_subnormals_signed_zero_nan_and_short_rows(kernels):
    probs, routing_map, pre_probs, pre_map = routing_case(64, 16, 4, torch.float32, seed=5)
    tiny = torch.tensor([1e-40, 2e-40, 3e-40, 1e-45], device="cuda")  # distinct float32 subnormals
    pre_probs[0, :4] = tiny
    pre_map[0] = False
    pre_map[0, :4] = True
    pre_probs[1, :2] = torch.tensor([-0.0, 0.0], device="cuda")
    pre_map[1, :2] = True
    pre_probs[2, 3] = float("nan")
    pre_map[2, 3] = True
    pre_map[3] = False  # no expert chosen: every slot is the sentinel
    pre_map[4] = False
    pre_map[4, 7] = True  # fewer chosen than k
    routing_map = pre_map.clone()
    routing_map[5] = False  # every route of a token dropped
    probs = pre_probs * routing_map
    case = (probs, routing_map, pre_probs, pre_map)
    got = rc._select_on_device(kernels, *case, 4)
    assert_same_bits(got, reference(*case, 4))
    assert got[0][0].tolist() == [2, 1, 0, 3]  # subnormals keep their order (no flush to zero)
    assert got[0][3].tolist() == [16] * 4


def test_beyond_the_kernels_limits_select_falls_back_to_the_reference(kernels):
    k = kernels.ROUTER_SELECT_MAX_K + 1
    case = routing_case(100, 64, k, torch.float32, seed=3)
    assert not rc._kernel_takes(kernels, *case, k)
    assert_same_bits(rc.select(*case, k), reference(*case, k))


def _host_us_per_call(fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _kernels_launched(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_host_cost_of_one_moe_layer(kernels):
    """What the fusion is for: host time and device work items per router firing (8192 tokens,
    16 experts, top-4, the benchmark's shape)."""
    case = routing_case(8192, 16, 4, torch.float32, seed=11, drop_share=0.1)
    fused = lambda: rc._select_on_device(kernels, *case, 4)  # noqa: E731
    torch_ops = lambda: reference(*case, 4)  # noqa: E731
    data = {
        "shape": "tokens 8192, experts 16, top-4, float32",
        "fused_host_us": _host_us_per_call(fused),
        "reference_host_us": _host_us_per_call(torch_ops),
        "fused_device_ops": _kernels_launched(fused),
        "reference_device_ops": _kernels_launched(torch_ops),
    }
    print(f"\n[dmi-gpu] router_select: {json.dumps(data)}")
    out = os.environ.get("DMI_RESULTS_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "router_select.json").write_text(json.dumps(data, indent=2))
    assert data["fused_device_ops"] <= 2 < data["reference_device_ops"]
    assert data["fused_host_us"] < data["reference_host_us"]
