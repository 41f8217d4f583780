"""Attention (``attn.*``): a forward hook on each layer's ``self_attention.core_attention`` sees the
post-RoPE query and key (its inputs) and the context (its output), this rank's heads of each; one on
``self_attention`` sees the block's output (``attn.out``)."""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.hooks.groups.base import Shards, SiteInstaller, first, publish
from megatron.core.dmi.key import ParallelCoords

GROUP = "attn"


def core_attention_of(module: TransformerLayer):
    """The layer's core attention module, or None (a layer without self-attention)."""
    return getattr(getattr(module, "self_attention", None), "core_attention", None)


def layer_site(hooks: SiteInstaller, module: TransformerLayer, coords: ParallelCoords) -> None:
    """attn.context, attn.q and attn.k of one layer, from its core attention's inputs and output, and
    attn.out from its self-attention block's output."""
    core_attention = core_attention_of(module)
    if core_attention is None:
        return
    layer = module.layer_number - 1
    shards = Shards.of(module.config, coords)

    def hook(attention, args, kwargs, output):
        context = first(output)
        publish(hooks, layer, shards, context.shape[0], {"attn.context": context, "attn.q": args[0], "attn.k": args[1]})

    def block_output(attention, args, output):
        out = first(output)
        publish(hooks, layer, shards, out.shape[0], {"attn.out": out})

    hooks.hold(core_attention.register_forward_hook(hook, with_kwargs=True))
    if "attn.out" in hooks.capture.config.hooks:
        hooks.hold(module.self_attention.register_forward_hook(block_output))
    hooks.placed(layer, GROUP)
