"""Find the capture points in megatron-core model chunks and attach DMI to them.

Router: the TopKRouter instance's ``routing`` is wrapped (its inputs are the gating logits, its
outputs the post-drop selection). Attention: a forward hook on ``self_attention.core_attention``
sees post-RoPE query/key (inputs) and the context (output). Every site knows its global layer and
its rank's parallel coordinates; the Capture decides per firing whether a record is made.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi import catalog
from megatron.core.dmi.capture import Capture, Placement
from megatron.core.dmi.hooks import router as router_capture
from megatron.core.dmi.records import ParallelCoords


def rank_coords(vpp: int = 0) -> ParallelCoords:
    """This process's coordinates in every parallel group (0 where a group is not initialised)."""

    def safe(fn: Callable[[], int]) -> int:
        try:
            return int(fn() or 0)  # an uninitialised group answers None or raises
        except (AssertionError, AttributeError, RuntimeError):
            return 0

    return ParallelCoords(
        rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        tp=safe(ps.get_tensor_model_parallel_rank),
        pp=safe(ps.get_pipeline_model_parallel_rank),
        vpp=vpp,
        dp=safe(ps.get_data_parallel_rank),
        cp=safe(ps.get_context_parallel_rank),
        ep=safe(ps.get_expert_model_parallel_rank),
        etp=safe(ps.get_expert_tensor_parallel_rank),
    )


def tp_size() -> int:
    try:
        return ps.get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 1


class HookSet:
    """Capture points installed on model chunks; ``remove`` restores every module exactly."""

    def __init__(self, capture: Capture):
        self.capture = capture
        self.layers: dict[int, list[str]] = {}  # global layer -> sites, for the topology record
        self._handles: list = []
        self._wrapped_routers: list[TopKRouter] = []
        self._stack = contextlib.ExitStack()
        self._groups = {catalog.BY_NAME[o].group for o in capture.config.hooks}
        if "router" in self._groups:
            self._stack.enter_context(router_capture.pre_drop_visible())

    def attach(self, chunk: torch.nn.Module, vpp: int = 0) -> None:
        """Attach DMI to every transformer layer of one (virtual pipeline) model chunk."""
        coords = rank_coords(vpp=vpp)
        for module in chunk.modules():
            if not isinstance(module, TransformerLayer):
                continue
            layer = module.layer_number - 1
            router = getattr(getattr(module, "mlp", None), "router", None)
            if "router" in self._groups and isinstance(router, TopKRouter):
                _router_site(self, router, layer, coords)
            core_attention = getattr(getattr(module, "self_attention", None), "core_attention", None)
            if "attn" in self._groups and core_attention is not None:
                _attention_site(self, core_attention, layer, coords)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for r in self._wrapped_routers:
            del r.routing  # drops the instance attribute; the class method is visible again
        self._stack.close()
        self._handles.clear()
        self._wrapped_routers.clear()


def _router_site(hooks: HookSet, router: TopKRouter, layer: int, coords: ParallelCoords) -> None:
    capture = hooks.capture
    tp, tp_rank = tp_size(), coords.tp
    sequence_parallel = bool(router.config.sequence_parallel) and tp > 1
    wanted = catalog.outputs_of_group("router", capture.config.hooks)
    original = router.routing

    def routing(logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = original(logits, *args, **kwargs)
        pre = router_capture.take_pre_drop()
        # Without sequence parallelism every TP rank routes the same tokens: rank 0 speaks for all.
        if not (sequence_parallel or tp_rank == 0) or not any(capture.wants(o, layer) for o in wanted):
            return probs, routing_map
        pre_probs, pre_map = pre if pre is not None else (probs, routing_map)
        flat_logits = logits.reshape(-1, logits.shape[-1])
        n = flat_logits.shape[0]
        shards = tp if sequence_parallel else 1
        start = (tp_rank if sequence_parallel else 0) * n
        where = Placement(start, start + n, n * shards)
        values: dict[str, Callable[[], torch.Tensor]] = {
            "router.logits": lambda: flat_logits,
            "router.topk_ids": lambda: selection()[0],
            "router.topk_probs": lambda: selection()[1],
            "router.expert_counts": lambda: selection()[2],
        }
        cached = {}

        def selection():
            if "v" not in cached:
                cached["v"] = router_capture.select(probs, routing_map, pre_probs, pre_map, router.topk)
            return cached["v"]

        with torch.no_grad():
            capture.publish_all(layer, coords, where, {o: values[o]() for o in wanted if capture.wants(o, layer)})
        return probs, routing_map

    router.routing = routing
    hooks._wrapped_routers.append(router)
    hooks.layers.setdefault(layer, []).append("router")


def _attention_site(hooks: HookSet, core_attention: torch.nn.Module, layer: int, coords: ParallelCoords) -> None:
    capture = hooks.capture
    tp = tp_size()
    wanted = catalog.outputs_of_group("attn", capture.config.hooks)

    def hook(module, args, kwargs, output):
        if not any(capture.wants(o, layer) for o in wanted):
            return
        query, key = args[0], args[1]
        context = output[0] if isinstance(output, tuple) else output
        seq = context.shape[0]
        where = Placement(0, seq, seq, shard_index=coords.tp, shard_count=tp)
        values = {"attn.context": context, "attn.q": query, "attn.k": key}
        with torch.no_grad():
            capture.publish_all(layer, coords, where, {o: values[o] for o in wanted if capture.wants(o, layer)})

    hooks._handles.append(core_attention.register_forward_hook(hook, with_kwargs=True))
    hooks.layers.setdefault(layer, []).append("attn")
