"""Find the capture points in megatron-core model chunks and attach DMI to them.

Router: the TopKRouter instance's ``routing`` is wrapped (its inputs are the gating logits, its
outputs the post-drop selection). Attention: a forward hook on ``self_attention.core_attention``
sees post-RoPE query/key (inputs) and the context (output). Residual stream: a forward pre-hook on
each layer's ``input_layernorm`` (IdentityOp when the norm is fused into the QKV projection) sees
the layer input, one on the block's ``final_layernorm`` the last layer's output, and a pre-hook on
the block publishes its routers' weights once per iteration. MLP: a forward hook on ``mlp`` and, for
``mlp.experts``, one on the MoE layer's ``experts`` (rows placed by the dispatcher's map). Loss:
a forward hook on the language model (GPTModel) given labels. Gradients: tensor hooks set in the
forward on the layer input, the core-attention output and the routing input fire in backward. The
sub-module sites sit inside the layer, so they fire inside a layer's CUDA graph and inside
activation recompute like the router and attention sites do. Every site knows its global layer and
its rank's parallel coordinates; the Capture decides per firing whether a record is made.

Each catalog group has one site function below (``_LAYER_SITES``, ``_BLOCK_SITES``, ``_MODEL_SITES``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core import parallel_state as ps
from megatron.core.dmi import catalog
from megatron.core.dmi.capture import Capture, Placement
from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.hooks import experts as expert_capture
from megatron.core.dmi.hooks import router as router_capture
from megatron.core.dmi.key import ParallelCoords


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
    """The tensor-parallel world size (1 where the group is not initialised)."""
    try:
        return ps.get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 1


class HookSet:
    """Capture points installed on model chunks; ``remove`` restores every module exactly."""

    def __init__(self, capture: Capture):
        """Prepare the sites of the groups ``capture``'s config selects; with the router group, megatron-core's token
        dropping is recorded (``pre_drop_visible``) until ``remove``."""
        self.capture = capture
        self.layers: dict[int, list[str]] = {}  # global layer -> sites, for the topology record
        self._handles: list = []
        # (object, method name) whose instance attribute wraps the class's method (router.routing,
        # the alltoall dispatcher's token_combine)
        self._wrapped: list[tuple[object, str]] = []
        self._stack = contextlib.ExitStack()
        self._groups = {catalog.BY_NAME[o].group for o in capture.config.hooks}
        if "router" in self._groups:
            self._stack.enter_context(router_capture.pre_drop_visible())

    def attach(self, chunk: torch.nn.Module, vpp: int = 0) -> None:
        """Attach DMI to one (virtual pipeline) model chunk: its language model, transformer block and
        transformer layers, each with the site functions of the selected groups."""
        coords = rank_coords(vpp=vpp)
        for module in chunk.modules():
            if isinstance(module, LanguageModule):
                sites = _MODEL_SITES
            elif isinstance(module, TransformerBlock):
                sites = _BLOCK_SITES
            elif isinstance(module, TransformerLayer):
                sites = _LAYER_SITES
            else:
                continue
            for group, site in sites.items():
                if group in self._groups:
                    site(self, module, coords)

    def remove(self) -> None:
        """Remove every hook and method wrapper and exit the contexts entered, restoring the modules."""
        for h in self._handles:
            h.remove()
        for obj, name in self._wrapped:
            delattr(obj, name)  # drops the instance attribute; the class method is visible again
        self._stack.close()
        self._handles.clear()
        self._wrapped.clear()

    def wrap(self, obj: object, name: str, wrapper: Callable) -> None:
        """Replace ``obj.name`` by ``wrapper`` on this instance until ``remove`` (wrapping a wrapper
        again is fine: its removal restores the class's method)."""
        setattr(obj, name, wrapper)
        if (obj, name) not in self._wrapped:
            self._wrapped.append((obj, name))


@dataclass(frozen=True)
class TokenShards:
    """How a TP group holds the tokens of a "sequence" output (catalog.Producers): under sequence
    parallelism each TP rank holds its own slice; without it every TP rank holds the same rows and
    TP rank 0 speaks for all."""

    tp: int
    tp_rank: int
    sequence_parallel: bool

    @classmethod
    def of(cls, config, coords: ParallelCoords) -> TokenShards:
        """How this rank's TP group holds tokens, from ``config``'s sequence parallelism and ``coords``."""
        tp = tp_size()
        return cls(tp, coords.tp, bool(config.sequence_parallel) and tp > 1)

    def placement(self, rows: int) -> Placement | None:
        """Where this rank's ``rows`` token rows sit along dim 0, or None when another rank publishes them."""
        if self.sequence_parallel:
            start = self.tp_rank * rows
            return Placement(start, start + rows, rows * self.tp)
        return Placement(0, rows, rows) if self.tp_rank == 0 else None


def _publish_sequence(hooks: HookSet, layer: int, coords: ParallelCoords, shards: TokenShards, tensors: dict) -> None:
    """Publish [rows, ...] tensors whose dim 0 is this rank's tokens."""
    if hooks.capture.idle:
        return
    wanted = {o: t for o, t in tensors.items() if hooks.capture.wants(o, layer)}
    if not wanted:
        return
    where = shards.placement(next(iter(wanted.values())).shape[0])
    if where is not None:
        with torch.no_grad():
            hooks.capture.publish_all(layer, coords, where, wanted)


def _router_site(hooks: HookSet, module: TransformerLayer, coords: ParallelCoords) -> None:
    router = getattr(getattr(module, "mlp", None), "router", None)
    if not isinstance(router, TopKRouter):
        return
    layer = module.layer_number - 1
    capture = hooks.capture
    wanted = catalog.outputs_of_group("router", capture.config.hooks)
    original = router.routing
    shards = TokenShards.of(router.config, coords)

    def routing(logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = original(logits, *args, **kwargs)
        pre = router_capture.take_pre_drop()
        if capture.idle:
            return probs, routing_map
        flat_logits = logits.reshape(-1, logits.shape[-1])
        where = shards.placement(flat_logits.shape[0])
        if where is None or not any(capture.wants(o, layer) for o in wanted):
            return probs, routing_map
        pre_probs, pre_map = pre if pre is not None else (probs, routing_map)
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

    hooks.wrap(router, "routing", routing)
    hooks.layers.setdefault(layer, []).append("router")


def _attention_site(hooks: HookSet, module: TransformerLayer, coords: ParallelCoords) -> None:
    core_attention = getattr(getattr(module, "self_attention", None), "core_attention", None)
    if core_attention is None:
        return
    layer = module.layer_number - 1
    capture = hooks.capture
    tp = tp_size()
    wanted = catalog.outputs_of_group("attn", capture.config.hooks)

    def hook(module, args, kwargs, output):
        if capture.idle or not any(capture.wants(o, layer) for o in wanted):
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


def _resid_in_site(hooks: HookSet, module: TransformerLayer, coords: ParallelCoords) -> None:
    # The layer's own pre-hook would not fire when megatron-core replays the layer as a CUDA graph;
    # its input norm is called inside the layer with exactly the hidden states the layer received.
    layer = module.layer_number - 1
    shards = TokenShards.of(module.config, coords)

    def hook(norm, args):
        _publish_sequence(hooks, layer, coords, shards, {"resid.in": args[0]})

    hooks._handles.append(module.input_layernorm.register_forward_pre_hook(hook))
    hooks.layers.setdefault(layer, []).append("resid")


def _mlp_site(hooks: HookSet, module: TransformerLayer, coords: ParallelCoords) -> None:
    layer = module.layer_number - 1
    shards = TokenShards.of(module.config, coords)

    def hook(mlp, args, output):
        out = output[0] if isinstance(output, tuple) else output
        _publish_sequence(hooks, layer, coords, shards, {"mlp.out": out})

    def shared_hook(shared, args, output):
        _publish_sequence(hooks, layer, coords, shards, {"mlp.shared": output})

    hooks._handles.append(module.mlp.register_forward_hook(hook))
    shared_experts = getattr(module.mlp, "shared_experts", None)
    if shared_experts is not None:
        hooks._handles.append(shared_experts.register_forward_hook(shared_hook))
    experts = getattr(module.mlp, "experts", None)
    if "mlp.experts" in hooks.capture.config.hooks and experts is not None:
        _watch_experts(hooks, module, experts, coords)
    hooks.layers.setdefault(layer, []).append("mlp")


def _watch_experts(hooks: HookSet, module: TransformerLayer, experts: torch.nn.Module, coords: ParallelCoords) -> None:
    """mlp.experts: every rank publishes rows no other rank publishes; a firing with no rows still
    publishes its empty record, so the record counts do not depend on the routing.

    Allgather dispatcher: the experts module's output, this rank's experts' rows for the tokens of its
    TP x EP group. Alltoall dispatcher: the rows of this rank's own tokens as the combine's
    all-to-all brings them back from every expert (expert tensor parallel partials already reduced),
    in the order this rank's permutation sent them."""
    config = module.config
    dispatcher = module.mlp.token_dispatcher
    kind = (
        "allgather"
        if isinstance(dispatcher, MoEAllGatherTokenDispatcher)
        else "alltoall"
        if isinstance(dispatcher, MoEAlltoAllTokenDispatcher)
        else config.moe_token_dispatcher_type
    )
    why = catalog.experts_unsupported(
        kind,
        tp_size(),
        bool(config.sequence_parallel),
        config.moe_expert_capacity_factor,
        getattr(config, "moe_latent_size", None),
        bool(getattr(config, "moe_router_padding_for_quantization", False)),
    )
    if why is not None:
        raise DMIError(f"{why[1]} ({why[0]})")
    layer = module.layer_number - 1
    capture = hooks.capture

    def publish(rows, local_map, permuted_probs, first_expert, group_ranks):
        with torch.no_grad():
            record = expert_capture.expert_rows(rows, local_map, permuted_probs, first_expert, group_ranks)
            n = record.shape[0]
            where = Placement(0, n, n, group_ranks.index(coords.rank), len(group_ranks))
            capture.publish_all(layer, coords, where, {"mlp.experts": record})

    if kind == "alltoall":
        token_combine = dispatcher.token_combine

        def combined(hidden_states, *args, **kwargs):
            rows = token_combine(hidden_states, *args, **kwargs)
            if not capture.idle and capture.wants("mlp.experts", layer):
                routing_map = dispatcher.routing_map
                # the probabilities in the order permute() put this rank's rows: by expert, tokens ascending
                permuted = dispatcher.probs.t().contiguous().masked_select(routing_map.t().contiguous())
                publish(rows, routing_map, permuted, 0, [coords.rank])
            return rows

        hooks.wrap(dispatcher, "token_combine", combined)
        return

    first_expert = dispatcher.local_expert_indices[0]
    group = dispatcher.tp_ep_group
    if torch.distributed.is_initialized() and group is not None:
        group_ranks = torch.distributed.get_process_group_ranks(group)
    else:
        group_ranks = [coords.rank]

    def hook(experts, args, output):
        if capture.idle or not capture.wants("mlp.experts", layer):
            return
        rows = output[0] if isinstance(output, tuple) else output
        publish(rows, dispatcher.local_map, args[2], first_expert, group_ranks)

    hooks._handles.append(experts.register_forward_hook(hook))


def _watch_gradient(
    hooks: HookSet,
    layer_module: TransformerLayer,
    output: str,
    coords: ParallelCoords,
    tensor: torch.Tensor,
    where: Placement | None,
    record_shape: tuple[int, ...],
) -> None:
    """Have the backward pass publish the gradient of ``tensor`` as ``output`` (shaped
    ``record_shape``) with this forward's step fields: a tensor hook fires once, with the gradient,
    when autograd has summed every use of the tensor. Evaluation forwards have no backward."""
    capture = hooks.capture
    layer = layer_module.layer_number - 1
    if where is None or not layer_module.training or not capture.wants(output, layer):
        return
    firing = capture.gradient_firing(output, layer, coords.vpp, tensor)
    if firing is None:
        return

    def publish(gradient: torch.Tensor) -> None:
        with torch.no_grad():
            capture.publish_gradient(output, layer, coords, where, gradient.reshape(record_shape), firing)

    tensor.register_hook(publish)


def _grad_site(hooks: HookSet, module: TransformerLayer, coords: ParallelCoords) -> None:
    """Gradients of a forward output, each from a tensor hook set on the tensor in the forward (see
    Capture.gradient_firing for recompute): grad.resid_in on the layer's input (a pre-hook on the
    layer: an input-norm pre-hook would see the norm's own recompute, whose gradient misses the
    residual path), grad.attn_context on the core-attention output, grad.router_logits on the
    routing step's input (the router's ``routing`` wrapped again; ``remove`` drops every wrapper)."""
    capture = hooks.capture
    wanted = catalog.outputs_of_group("grad", capture.config.hooks)
    shards = TokenShards.of(module.config, coords)

    def layer_input(layer_module, args, kwargs):
        if capture.idle:
            return
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        where = shards.placement(hidden.shape[0])
        _watch_gradient(hooks, module, "grad.resid_in", coords, hidden, where, hidden.shape)

    if "grad.resid_in" in wanted:
        hooks._handles.append(module.register_forward_pre_hook(layer_input, with_kwargs=True))

    core_attention = getattr(getattr(module, "self_attention", None), "core_attention", None)
    tp = tp_size()

    def attention_output(attention, args, output):
        if capture.idle:
            return
        context = output[0] if isinstance(output, tuple) else output
        seq = context.shape[0]
        where = Placement(0, seq, seq, shard_index=coords.tp, shard_count=tp)
        _watch_gradient(hooks, module, "grad.attn_context", coords, context, where, context.shape)

    if "grad.attn_context" in wanted and core_attention is not None:
        hooks._handles.append(core_attention.register_forward_hook(attention_output))

    router = getattr(getattr(module, "mlp", None), "router", None)
    if "grad.router_logits" in wanted and isinstance(router, TopKRouter):
        routing_step = router.routing
        router_shards = TokenShards.of(router.config, coords)

        def routing(logits: torch.Tensor, *args, **kwargs):
            if not capture.idle:
                experts = logits.shape[-1]
                rows = logits.numel() // experts
                where = router_shards.placement(rows)
                _watch_gradient(hooks, module, "grad.router_logits", coords, logits, where, (rows, experts))
            return routing_step(logits, *args, **kwargs)

        hooks.wrap(router, "routing", routing)
    hooks.layers.setdefault(module.layer_number - 1, []).append("grad")


def _resid_block_site(hooks: HookSet, block: TransformerBlock, coords: ParallelCoords) -> None:
    """resid.out at the final norm of the block holding the model's last layer, and router.weight of
    the block's MoE layers once per iteration (microbatch 0; TP rank 0 of DP rank 0 publishes: the
    router weight is replicated over TP, EP and DP)."""
    capture = hooks.capture
    last = [m for m in block.layers if m.layer_number == block.config.num_layers]
    if last:
        layer = last[0].layer_number - 1
        shards = TokenShards.of(block.config, coords)
        if block.final_layernorm is not None:

            def norm_input(norm, args):
                _publish_sequence(hooks, layer, coords, shards, {"resid.out": args[0]})

            hooks._handles.append(block.final_layernorm.register_forward_pre_hook(norm_input))
        else:  # no final norm: the last layer's output is the block's output

            def layer_output(module, args, output):
                _publish_sequence(hooks, layer, coords, shards, {"resid.out": output[0]})

            hooks._handles.append(last[0].register_forward_hook(layer_output))
    routers = {
        m.layer_number - 1: m.mlp.router
        for m in block.layers
        if isinstance(getattr(getattr(m, "mlp", None), "router", None), TopKRouter)
    }
    if not routers or coords.tp != 0 or coords.dp != 0:
        return

    def publish_weights(module, args, kwargs):
        if capture.idle or capture.step.microbatch != 0:
            return
        for layer, router in routers.items():
            if capture.wants("router.weight", layer):
                experts = router.weight.shape[0]
                with torch.no_grad():
                    capture.publish_all(
                        layer, coords, Placement(0, experts, experts), {"router.weight": router.weight.detach()}
                    )

    hooks._handles.append(block.register_forward_pre_hook(publish_weights, with_kwargs=True))


def _loss_site(hooks: HookSet, model: LanguageModule, coords: ParallelCoords) -> None:
    """loss.token from the language model's output when it is given labels (its output is then
    the per-token loss, [b, s]), with the loss_mask the forward step passed; every TP rank holds the
    same loss (the vocabulary-parallel cross entropy all-reduces), so TP rank 0 publishes."""
    if not model.post_process or coords.tp != 0:
        return
    capture = hooks.capture
    layer = model.config.num_layers - 1

    def hook(module, args, kwargs, output):
        if capture.idle or kwargs.get("labels") is None or not capture.wants("loss.token", layer):
            return
        with torch.no_grad():
            loss = output.detach().float().t()
            mask = kwargs.get("loss_mask")
            mask = torch.full_like(loss, float("nan")) if mask is None else mask.detach().float().t()
            loss_and_mask = torch.stack([loss, mask], dim=-1)
            rows = loss_and_mask.shape[0]
            capture.publish_all(layer, coords, Placement(0, rows, rows), {"loss.token": loss_and_mask})

    hooks._handles.append(model.register_forward_hook(hook, with_kwargs=True))


def _logits_site(hooks: HookSet, model: LanguageModule, coords: ParallelCoords) -> None:
    """logits.* from the output layer's logits of a forward given labels, published in the output
    layer's hook: the vocabulary-parallel cross entropy then overwrites the logits in place. The
    model's pre-hook hands the labels over; the first output-layer call of the forward takes them
    (start-up refuses these outputs with multi-token prediction, whose heads call it first)."""
    if not model.post_process:
        return
    capture = hooks.capture
    layer = model.config.num_layers - 1
    tp = tp_size()
    wanted = catalog.outputs_of_group("logits", capture.config.hooks)
    pending: dict[str, torch.Tensor] = {}

    def take_labels(module, args, kwargs):
        pending.pop("labels", None)
        if kwargs.get("labels") is not None:
            pending["labels"] = kwargs["labels"]

    def publish(module, args, output):
        labels = pending.pop("labels", None)
        selected = [o for o in wanted if capture.wants(o, layer)]
        if labels is None or not selected:
            return
        logits = output[0] if isinstance(output, tuple) else output
        with torch.no_grad():
            values = vocabulary_views(
                logits.detach(), labels.t(), coords.tp * logits.shape[-1], capture.config.logits_topk, selected
            )
            rows = logits.shape[0]
            capture.publish_all(layer, coords, Placement(0, rows, rows, shard_index=coords.tp, shard_count=tp), values)

    hooks._handles.append(model.register_forward_pre_hook(take_labels, with_kwargs=True))
    hooks._handles.append(model.output_layer.register_forward_hook(publish))


def vocabulary_views(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, k: int, outputs: list[str]
) -> dict[str, torch.Tensor]:
    """The logits.* outputs of one vocabulary shard: logits [s, b, V_local] (ids vocab_start..),
    labels [s, b] global ids. See catalog.py for each output's layout."""
    out = {}
    if "logits.topk" in outputs:
        top = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1)
        out["logits.topk"] = torch.stack([top.values, (top.indices + vocab_start).float()], dim=-1)
    if "logits.target" in outputs:
        shard = logits.float()
        peak = shard.max(dim=-1).values
        total = torch.exp(shard - peak.unsqueeze(-1)).sum(dim=-1)
        local = labels - vocab_start
        inside = (local >= 0) & (local < shard.shape[-1])
        label_logit = shard.gather(-1, local.clamp(0, shard.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        label_logit = torch.where(inside, label_logit, torch.full_like(label_logit, float("-inf")))
        out["logits.target"] = torch.stack([peak, total, label_logit], dim=-1)
    if "logits.full" in outputs:
        out["logits.full"] = logits
    return out


_LAYER_SITES = {
    "router": _router_site,
    "attn": _attention_site,
    "resid": _resid_in_site,
    "mlp": _mlp_site,
    "grad": _grad_site,
}
_BLOCK_SITES = {"resid": _resid_block_site}
_MODEL_SITES = {"loss": _loss_site, "logits": _logits_site}
