"""Logits (``logits.*``): views of the output layer's logits of a forward given labels, each TP rank
publishing its vocabulary shard."""

from __future__ import annotations

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule

from megatron.core.dmi import catalog
from megatron.core.dmi.hooks.groups.base import HookSite, ModelFacts, Refusal, Shards, SiteInstaller, first
from megatron.core.dmi.key import ParallelCoords

GROUP = "logits"


def refusal(outputs: frozenset[str], facts: ModelFacts) -> Refusal | None:
    """Multi-token prediction's heads call the output layer before the main head does, so the labels
    handed to the first call would be published with the wrong logits."""
    if facts.mtp_layers:
        return "--dmi-hooks", "logits outputs are not supported with multi-token prediction (--mtp-num-layers)"
    return None


def model_site(hooks: SiteInstaller, model: LanguageModule, coords: ParallelCoords) -> None:
    """logits.* published in the output layer's hook (the vocabulary-parallel cross entropy then
    overwrites the logits in place). The model's pre-hook hands the labels over; the first
    output-layer call of the forward takes them (``refusal`` rules out multi-token prediction)."""
    if not model.post_process:
        return
    capture = hooks.capture
    shards = Shards.of(model.config, coords)
    declared = catalog.outputs_of_group(GROUP, capture.config.hooks)
    site = HookSite(capture, model.config.num_layers - 1, shards, declared)
    if not site.outputs:
        return
    selected = [output for _, output in site.outputs]
    pending: dict[str, torch.Tensor] = {}

    def take_labels(module, args, kwargs):
        if capture.idle:
            return
        pending.pop("labels", None)
        if kwargs.get("labels") is not None:
            pending["labels"] = kwargs["labels"]

    def hook(module, args, output):
        if capture.idle:
            return
        labels = pending.pop("labels", None)
        if labels is None or not capture.recording():
            return
        logits = first(output).detach()
        with torch.no_grad():
            views = vocabulary_views(
                logits, labels.t(), coords.tp * logits.shape[-1], capture.config.logits_topk, selected
            )
        site.publish(logits.shape[0], [views.get(output) for output in declared])

    hooks.hold(model.register_forward_pre_hook(take_labels, with_kwargs=True))
    hooks.hold(model.output_layer.register_forward_hook(hook))


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
