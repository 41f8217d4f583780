"""Router (``router.*``): logits, top-k ids with dropped-route sentinels, top-k weights, expert counts.

The TopKRouter instance's ``routing`` is wrapped: its input is the gating logits, and it returns
the post-capacity-drop (probs, routing_map) as dense [tokens, E] tensors. The pre-drop selection is
seen by wrapping megatron-core's token-dropping function while the hooks are installed.
"""

from __future__ import annotations

import contextlib
import threading

import megatron.core.transformer.moe.router as mcore_router
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.hooks.groups.base import HookSite, ModelFacts, Refusal, Shards, SiteInstaller
from megatron.core.dmi.key import ParallelCoords
from megatron.core.dmi.transport import abi, jit

GROUP = "router"

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
        _pre_drop.selection = None


def take_pre_drop() -> tuple[torch.Tensor, torch.Tensor] | None:
    """The router's selection before capacity dropping, recorded by the last routing; cleared."""
    sel = getattr(_pre_drop, "selection", None)
    _pre_drop.selection = None
    return sel


# the kernel's dtype codes, from the one table both sides share
_KERNEL_DTYPES = {getattr(torch, name): code for name, code in abi.ROUTER_DTYPE.items()}


def select(
    probs: torch.Tensor, routing_map: torch.Tensor, pre_probs: torch.Tensor, pre_map: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk ids, topk weights, expert counts): ``topk_view`` and ``expert_counts`` in one go.

    On a GPU where this process loaded DMI's CUDA build (the native transport does), one fused
    kernel (csrc/dmi/router_select.cu) computes all three: a memset and one launch instead of
    about twenty, which counts in an eager MoE step, where the host is the bottleneck. Elsewhere,
    and beyond the kernel's limits, the torch reference below; both give the same bits.
    """
    kernels = jit.loaded("cuda")
    if kernels is not None and _kernel_takes(kernels, probs, routing_map, pre_probs, pre_map, topk):
        return _select_on_device(kernels, probs, routing_map, pre_probs, pre_map, topk)
    ids, weights = topk_view(probs, routing_map, pre_probs, pre_map, topk)
    return ids, weights, expert_counts(routing_map, pre_map)


def _kernel_takes(kernels, probs, routing_map, pre_probs, pre_map, topk: int) -> bool:
    """Whether the fused kernel takes these: [tokens, E] each on one CUDA device, the router's dtypes,
    k and E within its limits. Without capacity dropping the pre-drop pair is the post-drop pair
    itself and is not checked again (every firing asks)."""
    if not probs.is_cuda or probs.dim() != 2 or probs.dtype not in _KERNEL_DTYPES or routing_map.dtype != torch.bool:
        return False
    shape, device = probs.shape, probs.device
    if routing_map.shape != shape or routing_map.device != device:
        return False
    if pre_probs is not probs and (
        pre_probs.shape != shape or pre_probs.device != device or pre_probs.dtype != probs.dtype
    ):
        return False
    if pre_map is not routing_map and (
        pre_map.shape != shape or pre_map.device != device or pre_map.dtype != torch.bool
    ):
        return False
    experts = shape[1]
    return 1 <= topk <= min(kernels.ROUTER_SELECT_MAX_K, experts) and experts <= kernels.ROUTER_SELECT_MAX_EXPERTS


def _select_on_device(kernels, probs, routing_map, pre_probs, pre_map, topk: int):
    dropped = pre_probs is not probs or pre_map is not routing_map
    probs, routing_map = probs.contiguous(), routing_map.contiguous()
    pre_probs, pre_map = (pre_probs.contiguous(), pre_map.contiguous()) if dropped else (probs, routing_map)
    tokens, num_experts = probs.shape
    device = probs.device
    ids = torch.empty((tokens, topk), dtype=torch.int32, device=device)
    weights = torch.empty((tokens, topk), dtype=probs.dtype, device=device)
    counts = torch.empty((2, num_experts), dtype=torch.int32, device=device)
    kernels.router_select(
        probs.data_ptr(),
        routing_map.data_ptr(),
        pre_probs.data_ptr(),
        pre_map.data_ptr(),
        tokens,
        num_experts,
        topk,
        _KERNEL_DTYPES[probs.dtype],
        ids.data_ptr(),
        weights.data_ptr(),
        counts.data_ptr(),
        torch._C._cuda_getCurrentRawStream(device.index),  # no torch.cuda.Stream per firing
    )
    return ids, weights, counts


def topk_view(
    probs: torch.Tensor, routing_map: torch.Tensor, pre_probs: torch.Tensor, pre_map: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, k] expert ids (sentinel E where capacity dropped the route) and their weights
    (torch reference of the fused kernel).

    Slots are ordered by pre-drop probability, descending; a stable sort puts the lower expert id
    first on ties, so the order is fully determined by the router's own outputs.
    """
    num_experts = probs.shape[-1]
    ids = pre_drop_ids(pre_probs, pre_map, topk)
    kept = routing_map.gather(1, ids)
    weights = probs.gather(1, ids) * kept
    ids = torch.where(kept, ids, torch.full_like(ids, num_experts))
    return ids.to(torch.int32), weights


def pre_drop_ids(pre_probs: torch.Tensor, pre_map: torch.Tensor, topk: int) -> torch.Tensor:
    """[tokens, k] int64: the pre-drop selection in ``topk_view``'s slot order (``router.selected``)."""
    score = pre_probs.float().masked_fill(~pre_map, float("-inf"))
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :topk]


def expert_counts(routing_map: torch.Tensor, pre_map: torch.Tensor) -> torch.Tensor:
    """[2, E]: tokens per expert before (row 0) and after (row 1) capacity dropping."""
    return torch.stack([pre_map.sum(0), routing_map.sum(0)]).to(torch.int32)


def refusal(outputs: frozenset[str], facts: ModelFacts) -> Refusal | None:
    """A dense model has no router to record."""
    if not facts.moe:
        return "--dmi-hooks", "router outputs need a MoE model (--num-experts)"
    return None


# what the router's wrapper hands its HookSite, in this order (the order of the firing's records)
OUTPUTS = ("router.logits", "router.topk_ids", "router.topk_probs", "router.expert_counts", "router.selected")
_SELECTION = frozenset(OUTPUTS[1:4])  # the outputs ``select`` computes together


def layer_site(hooks: SiteInstaller, module: TransformerLayer, coords: ParallelCoords) -> None:
    """router.* of one MoE layer: its TopKRouter's ``routing`` wrapped until ``HookSet.remove``
    (not wrapped where this rank publishes none of them at this layer)."""
    router = getattr(getattr(module, "mlp", None), "router", None)
    if not isinstance(router, TopKRouter):
        return
    layer = module.layer_number - 1
    hooks.placed(layer, GROUP)
    capture = hooks.capture
    site = HookSite(capture, layer, Shards.of(router.config, coords), OUTPUTS)
    if not site.outputs:
        return
    original = router.routing
    topk = router.topk
    selecting = any(site.publishes(o) for o in _SELECTION)
    pre_drop_selected = site.publishes("router.selected")

    def routing(logits: torch.Tensor, *args, **kwargs):
        if capture.idle:
            return original(logits, *args, **kwargs)
        _pre_drop.selection = None  # only this call's capacity dropping counts
        probs, routing_map = original(logits, *args, **kwargs)
        if not capture.recording():
            return probs, routing_map
        pre = take_pre_drop()
        pre_probs, pre_map = pre if pre is not None else (probs, routing_map)
        # megatron-core's router hands [tokens, E] already: a reshape would cost two dispatcher calls per firing
        flat_logits = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])
        ids = weights = counts = selected = None
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # a no_grad context costs microseconds more per firing
        try:
            if selecting:
                ids, weights, counts = select(probs, routing_map, pre_probs, pre_map, topk)
            if pre_drop_selected:
                selected = pre_drop_ids(pre_probs, pre_map, topk).to(torch.int32)
        finally:
            torch._C._set_grad_enabled(grad)
        site.publish(flat_logits.shape[0], (flat_logits, ids, weights, counts, selected))
        return probs, routing_map

    hooks.wrap(router, "routing", routing)
