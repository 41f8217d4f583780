"""Attention (``attn.*``): a forward hook on each layer's ``self_attention.core_attention`` sees the
post-RoPE query and key (its inputs) and the context (its output), this rank's heads of each; one on
``self_attention`` sees the block's output (``attn.out``)."""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.hooks.groups.base import HookSite, Shards, SiteInstaller, first
from megatron.core.dmi.key import ParallelCoords

GROUP = "attn"


def core_attention_of(module: TransformerLayer):
    """The layer's core attention module, or None (a layer without self-attention)."""
    return getattr(getattr(module, "self_attention", None), "core_attention", None)


def layer_site(hooks: SiteInstaller, module: TransformerLayer, coords: ParallelCoords) -> None:
    """attn.context, attn.q and attn.k of one layer, from its core attention's inputs and output, and
    attn.out from its self-attention block's output (a hook only where this rank publishes one)."""
    core_attention = core_attention_of(module)
    if core_attention is None:
        return
    layer = module.layer_number - 1
    hooks.placed(layer, GROUP)
    capture = hooks.capture
    shards = Shards.of(module.config, coords)
    core_site = HookSite(capture, layer, shards, ("attn.context", "attn.q", "attn.k"))
    block_site = HookSite(capture, layer, shards, ("attn.out",))

    def hook(attention, args, kwargs, output):
        if capture.idle:
            return
        if capture.recording():
            context = first(output)
            core_site.publish(context.shape[0], (context, args[0], args[1]))

    def block_output(attention, args, output):
        if capture.idle:
            return
        if capture.recording():
            out = first(output)
            block_site.publish(out.shape[0], (out,))

    if core_site.outputs:
        hooks.hold(core_attention.register_forward_hook(hook, with_kwargs=True))
    if block_site.outputs:
        hooks.hold(module.self_attention.register_forward_hook(block_output))
