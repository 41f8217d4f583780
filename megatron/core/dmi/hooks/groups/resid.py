"""Residual stream (``resid.*``, ``router.weight``): the layer input at each layer's input norm, the
last layer's output at the block's final norm, and the routers' weights once per iteration."""

from __future__ import annotations

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.hooks.groups.base import HookSite, Shards, SiteInstaller
from megatron.core.dmi.key import ParallelCoords

GROUP = "resid"


def layer_site(hooks: SiteInstaller, module: TransformerLayer, coords: ParallelCoords) -> None:
    """resid.in from a forward pre-hook on the layer's input norm (IdentityOp when the norm is fused
    into the QKV projection)."""
    # The layer's own pre-hook would not fire when megatron-core replays the layer as a CUDA graph;
    # its input norm is called inside the layer with exactly the hidden states the layer received.
    layer = module.layer_number - 1
    hooks.placed(layer, GROUP)
    capture = hooks.capture
    site = HookSite(capture, layer, Shards.of(module.config, coords), ("resid.in",))

    def hook(norm, args):
        if capture.idle:
            return
        if capture.recording():
            site.publish(args[0].shape[0], args)

    if site.outputs:
        hooks.hold(module.input_layernorm.register_forward_pre_hook(hook))


def block_site(hooks: SiteInstaller, block: TransformerBlock, coords: ParallelCoords) -> None:
    """resid.out at the final norm of the block holding the model's last layer, and router.weight of
    the block's MoE layers once per iteration (microbatch 0; producers "one": the router weight is
    replicated over TP, EP and DP)."""
    capture = hooks.capture
    shards = Shards.of(block.config, coords)
    last = [m for m in block.layers if m.layer_number == block.config.num_layers]
    out_site = HookSite(capture, block.config.num_layers - 1, shards, ("resid.out",))
    if last and out_site.outputs:
        if block.final_layernorm is not None:

            def norm_input(norm, args):
                if capture.idle:
                    return
                if capture.recording():
                    out_site.publish(args[0].shape[0], args)

            hooks.hold(block.final_layernorm.register_forward_pre_hook(norm_input))
        else:  # no final norm: the last layer's output is the block's output

            def layer_output(module, args, output):
                if capture.idle:
                    return
                if capture.recording():
                    out_site.publish(output[0].shape[0], output)

            hooks.hold(last[0].register_forward_hook(layer_output))
    weight_sites = [
        (m.mlp.router, HookSite(capture, m.layer_number - 1, shards, ("router.weight",)))
        for m in block.layers
        if isinstance(getattr(getattr(m, "mlp", None), "router", None), TopKRouter)
    ]
    weight_sites = [(router, site) for router, site in weight_sites if site.outputs]
    if not weight_sites:
        return

    def publish_weights(module, args, kwargs):
        if capture.idle or capture.step.microbatch != 0 or not capture.recording():
            return
        for router, site in weight_sites:
            site.publish(router.weight.shape[0], (router.weight.detach(),))

    hooks.hold(block.register_forward_pre_hook(publish_weights, with_kwargs=True))
