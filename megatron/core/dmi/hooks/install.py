"""Find the capture points in megatron-core model chunks and attach DMI to them.

``HookSet.attach`` walks a model chunk: on its language model, its ``TransformerBlock`` and every
``TransformerLayer`` it runs the site functions of the selected groups, one module per group in
``hooks/groups/`` (``groups.GROUP_MODULES``). The sub-module sites sit inside the layer, so they
fire inside a layer's CUDA graph and inside activation recompute. Every site knows its global layer
and its rank's parallel coordinates, and places its records by the catalog's ``producers``
(``groups.base.Shards``); what it publishes on this rank is fixed at attach (``groups.base.HookSite``:
no hook where that is nothing), and the Capture decides once per step (``idle``) and per firing
(``recording``) whether a record is made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi import catalog
from megatron.core.dmi.capture import Capture
from megatron.core.dmi.hooks import groups
from megatron.core.dmi.hooks.groups import router as router_group
from megatron.core.dmi.hooks.groups.base import ModelFacts, UnsupportedModelError, rank_coords

# which site function of a group module runs on which kind of module
_SITE_OF = ((LanguageModule, "model_site"), (TransformerBlock, "block_site"), (TransformerLayer, "layer_site"))


class HookSet:
    """Capture points installed on model chunks; ``remove`` restores every module exactly."""

    def __init__(self, capture: Capture):
        """Prepare the sites of the groups ``capture``'s config selects; with the router group, megatron-core's token
        dropping is recorded (``pre_drop_visible``) until ``remove``."""
        self.capture = capture
        self.layers: dict[int, list[str]] = {}  # global layer -> groups placed there, for the topology record
        self._handles: list = []
        # (object, method name) whose instance attribute wraps the class's method (router.routing,
        # the alltoall dispatcher's token_combine)
        self._wrapped: list[tuple[object, str]] = []
        self._stack = contextlib.ExitStack()
        self._groups = [g for g in groups.GROUP_MODULES if catalog.outputs_of_group(g, capture.config.hooks)]
        if "router" in self._groups:
            self._stack.enter_context(router_group.pre_drop_visible())

    def attach(self, chunk: torch.nn.Module, vpp: int = 0) -> None:
        """Attach DMI to one (virtual pipeline) model chunk: its language model, transformer block and
        transformer layers, each with the site functions of the selected groups.

        Raises:
            UnsupportedModelError: the chunk's configuration cannot be captured exactly for a selected
                output (the same check the flags' start-up runs, ``groups.refusal``).
        """
        coords = rank_coords(vpp=vpp)
        configs = [m.config for m in chunk.modules() if isinstance(m, (LanguageModule, TransformerLayer))]
        if configs:
            why = groups.refusal(self.capture.config.hooks, ModelFacts.of(configs[0]))
            if why is not None:
                raise UnsupportedModelError(f"{why[0]}: {why[1]}")
        # Multi-token prediction layers are not decoder layers: megatron-core numbers their inner
        # layer 1, which would collide with decoder layer 0's keys. They are not captured.
        in_mtp = {
            id(m) for block in chunk.modules() if isinstance(block, MultiTokenPredictionBlock) for m in block.modules()
        }
        for module in chunk.modules():
            site_name = next((name for kind, name in _SITE_OF if isinstance(module, kind)), None)
            if site_name is None or id(module) in in_mtp:
                continue
            for group in self._groups:
                site = getattr(groups.GROUP_MODULES[group], site_name, None)
                if site is not None:
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

    def hold(self, handle) -> None:
        """Keep a hook's removable handle until ``remove``."""
        self._handles.append(handle)

    def placed(self, layer: int, group: str) -> None:
        """Note that ``group`` has a site on global ``layer`` (the topology record lists them)."""
        self.layers.setdefault(layer, []).append(group)

    def wrap(self, obj: object, name: str, wrapper: Callable) -> None:
        """Replace ``obj.name`` by ``wrapper`` on this instance until ``remove`` (wrapping a wrapper
        again is fine: its removal restores the class's method)."""
        setattr(obj, name, wrapper)
        if (obj, name) not in self._wrapped:
            self._wrapped.append((obj, name))


__all__ = ["HookSet", "rank_coords"]
