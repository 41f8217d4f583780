"""Gradients (``grad.*``): tensor hooks set in the forward on the layer input, the core-attention
output and the routing input fire in backward with their gradients."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi import catalog
from megatron.core.dmi.hooks.groups.attn import core_attention_of
from megatron.core.dmi.hooks.groups.base import Shards, SiteInstaller, first
from megatron.core.dmi.key import ParallelCoords

GROUP = "grad"


def _watch_gradient(
    hooks: SiteInstaller,
    layer_module: TransformerLayer,
    output: str,
    shards: Shards,
    tensor: torch.Tensor,
    record_shape: tuple[int, ...],
) -> None:
    """Have the backward pass publish the gradient of ``tensor`` as ``output`` (shaped
    ``record_shape``) with this forward's step fields: a tensor hook fires once, with the gradient,
    when autograd has summed every use of the tensor. Evaluation forwards have no backward."""
    capture = hooks.capture
    layer = layer_module.layer_number - 1
    if not layer_module.training or not capture.wants(output, layer):
        return
    where = shards.placement(output, record_shape[0])
    if where is None:
        return
    firing = capture.gradient_firing(output, layer, shards.coords.vpp, tensor)
    if firing is None:
        return

    def publish(gradient: torch.Tensor) -> None:
        with torch.no_grad():
            capture.publish_gradient(output, layer, shards.coords, where, gradient.reshape(record_shape), firing)

    tensor.register_hook(publish)


def layer_site(hooks: SiteInstaller, module: TransformerLayer, coords: ParallelCoords) -> None:
    """Gradients of a forward output, each from a tensor hook set on the tensor in the forward (see
    Capture.gradient_firing for recompute): grad.resid_in on the layer's input (a pre-hook on the
    layer: an input-norm pre-hook would see the norm's own recompute, whose gradient misses the
    residual path), grad.attn_context on the core-attention output, grad.router_logits on the
    routing step's input (the router's ``routing`` wrapped again; ``remove`` drops every wrapper)."""
    capture = hooks.capture
    wanted = catalog.outputs_of_group(GROUP, capture.config.hooks)
    shards = Shards.of(module.config, coords)

    def layer_input(layer_module, args, kwargs):
        if capture.idle:
            return
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        _watch_gradient(hooks, module, "grad.resid_in", shards, hidden, hidden.shape)

    if "grad.resid_in" in wanted:
        hooks.hold(module.register_forward_pre_hook(layer_input, with_kwargs=True))

    core_attention = core_attention_of(module)

    def attention_output(attention, args, output):
        if capture.idle:
            return
        context = first(output)
        _watch_gradient(hooks, module, "grad.attn_context", shards, context, context.shape)

    if "grad.attn_context" in wanted and core_attention is not None:
        hooks.hold(core_attention.register_forward_hook(attention_output))

    router = getattr(getattr(module, "mlp", None), "router", None)
    if "grad.router_logits" in wanted and isinstance(router, TopKRouter):
        routing_step = router.routing
        router_shards = Shards.of(router.config, coords)

        def routing(logits: torch.Tensor, *args, **kwargs):
            if capture.idle:
                return routing_step(logits, *args, **kwargs)
            experts = logits.shape[-1]
            _watch_gradient(
                hooks, module, "grad.router_logits", router_shards, logits, (logits.numel() // experts, experts)
            )
            return routing_step(logits, *args, **kwargs)

        hooks.wrap(router, "routing", routing)
    hooks.placed(module.layer_number - 1, GROUP)
