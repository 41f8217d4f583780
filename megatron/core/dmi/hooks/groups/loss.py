"""Loss (``loss.token``): a forward hook on the language model given labels, whose output is then
the per-token loss [b, s]; the loss mask comes from the same call's arguments."""

from __future__ import annotations

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule

from megatron.core.dmi.hooks.groups.base import HookSite, Shards, SiteInstaller
from megatron.core.dmi.key import ParallelCoords

GROUP = "loss"


def model_site(hooks: SiteInstaller, model: LanguageModule, coords: ParallelCoords) -> None:
    """loss.token on the last pipeline stage, with the loss_mask the forward step passed; every TP
    rank holds the same loss (the vocabulary-parallel cross entropy all-reduces), so TP rank 0
    publishes (producers "replicated")."""
    if not model.post_process:
        return
    capture = hooks.capture
    site = HookSite(capture, model.config.num_layers - 1, Shards.of(model.config, coords), ("loss.token",))
    if not site.outputs:
        return

    def loss_and_mask(output, mask) -> torch.Tensor:
        loss = output.detach().float().t()
        mask = torch.full_like(loss, float("nan")) if mask is None else mask.detach().float().t()
        return torch.stack([loss, mask], dim=-1)

    def hook(module, args, kwargs, output):
        if capture.idle or kwargs.get("labels") is None or not capture.recording():
            return
        with torch.no_grad():
            record = loss_and_mask(output, kwargs.get("loss_mask"))
        site.publish(output.shape[1], (record,))  # [b, s]: the record is [s, b, 2]

    hooks.hold(model.register_forward_hook(hook, with_kwargs=True))
