"""Per-layer router scalars in TensorBoard and W&B, written through Megatron's own writers.

With ``--tensorboard-dir`` or ``--wandb-project`` and router outputs captured, every log interval
writes, for each captured MoE layer L (global, 0-based, zero-padded as in ``layer_03``):

* ``dmi/expert_load_imbalance/layer_LL``: max / mean of the tokens routed to each expert (the
  router's choice, before capacity dropping); 1.0 is perfectly balanced, E means one expert got
  everything. ``.../worst_layer``: the largest over layers.
* ``dmi/drop_rate/layer_LL``: share of routed token slots that capacity dropping removed (0 without
  a capacity factor). ``.../all_layers``: pooled over layers.
* ``dmi/router_entropy/layer_LL``: mean per-token entropy of the router's score distribution over
  all experts (softmax, or normalised sigmoid, of ``router.logits``), divided by log(E): 1.0 is a
  uniform router, 0 a one-hot one. ``.../all_layers``: pooled over layers.
* ``dmi/tokens_per_expert/layer_LL``: a histogram of the tokens each expert was routed per
  captured iteration (whole global batch), for TensorBoard's distributions.

Values cover the iterations and layers DMI captured since the last log interval (``--dmi-interval``,
``--dmi-layers``; train phase, original forwards), summed over every rank. The load metrics need
``router.expert_counts``, the entropy needs ``router.logits`` (``--dmi-hooks router`` has both).

Cost: on the hot path, a few small kernels per router firing that add into one device tensor of
``num_layers x (2E + 2)`` float64 (no host sync); at each log interval one reduce of that tensor to
the writer rank (the last, where Megatron keeps its writers) and one device-to-host copy there.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron.core.dmi.capture import StepContext

COUNTS, LOGITS = "router.expert_counts", "router.logits"


def wanted(args, hooks) -> bool:
    """Scalars are written when Megatron has a writer to take them and the router is captured."""
    return bool(getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", None)) and bool(
        {COUNTS, LOGITS} & set(hooks)
    )


def summarise(
    totals: torch.Tensor, num_experts: int, iterations: int
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """(scalars, histograms) by tag from the summed totals: one row per layer, columns
    [tokens per expert before dropping (E), after dropping (E), entropy sum, entropy tokens]."""
    experts = num_experts
    width = max(2, len(str(totals.shape[0] - 1)))
    before, after = totals[:, :experts], totals[:, experts : 2 * experts]
    entropy_sum, entropy_tokens = totals[:, 2 * experts], totals[:, 2 * experts + 1]
    scalars: dict[str, float] = {}
    histograms: dict[str, torch.Tensor] = {}
    routed = before.sum(1)
    imbalances = []
    for layer in torch.nonzero(routed > 0).flatten().tolist():
        name = f"layer_{layer:0{width}d}"
        imbalance = float(before[layer].max() / before[layer].mean())
        imbalances.append(imbalance)
        scalars[f"dmi/expert_load_imbalance/{name}"] = imbalance
        scalars[f"dmi/drop_rate/{name}"] = float(1 - after[layer].sum() / routed[layer])
        histograms[f"dmi/tokens_per_expert/{name}"] = before[layer] / max(iterations, 1)
    if imbalances:
        scalars["dmi/expert_load_imbalance/worst_layer"] = max(imbalances)
        scalars["dmi/drop_rate/all_layers"] = float(1 - after.sum() / routed.sum())
    for layer in torch.nonzero(entropy_tokens > 0).flatten().tolist():
        scalars[f"dmi/router_entropy/layer_{layer:0{width}d}"] = float(entropy_sum[layer] / entropy_tokens[layer])
    if entropy_tokens.sum() > 0:
        scalars["dmi/router_entropy/all_layers"] = float(entropy_sum.sum() / entropy_tokens.sum())
    return scalars, histograms


def normalised_entropy(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-token entropy of the router's score distribution over all experts, over log(E)."""
    logits = logits.float()
    if score_function == "sigmoid":
        scores = logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        probs = logits.softmax(-1)
    return torch.special.entr(probs).sum(-1) / math.log(logits.shape[-1])


class RouterScalars:
    """Sums the router outputs Capture publishes, on the device, between two log intervals."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        score_function: str,
        device: torch.device,
        captured_iterations: Callable[[int, int], int],
        start_iteration: int = 0,
    ):
        """Zeroed per-layer totals on ``device``; ``captured_iterations(first, last)`` counts the captured train
        iterations in that range, and ``start_iteration`` is the last one already written."""
        self.num_experts = num_experts
        self.score_function = score_function
        self.totals = torch.zeros(num_layers, 2 * num_experts + 2, dtype=torch.float64, device=device)
        self._captured_iterations = captured_iterations  # (first, last) -> captured train iterations
        self._last_written = start_iteration

    def observe(self, layer: int, step: StepContext, tensors: dict[str, torch.Tensor]) -> None:
        """A Capture observer: one router firing's published outputs (no host sync)."""
        if step.phase != "train" or layer >= self.totals.shape[0]:
            return
        experts = self.num_experts
        row = self.totals[layer]
        with torch.no_grad():
            if COUNTS in tensors:
                row[: 2 * experts].add_(tensors[COUNTS].reshape(-1))
            if LOGITS in tensors:
                logits = tensors[LOGITS]
                row[2 * experts].add_(normalised_entropy(logits, self.score_function).sum())
                row[2 * experts + 1].add_(logits.shape[0])

    def write(self, iteration: int, tensorboard, wandb) -> None:
        """Collective (every rank calls it at the log interval): sum the totals on the last rank,
        where Megatron's writers live, write them there, and start the next interval."""
        last = 0
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            last = torch.distributed.get_world_size() - 1
            torch.distributed.reduce(self.totals, dst=last)
        on_writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == last
        if on_writer and (tensorboard is not None or wandb is not None):
            iterations = self._captured_iterations(self._last_written + 1, iteration)
            scalars, histograms = summarise(self.totals.cpu(), self.num_experts, iterations)
            _write(iteration, scalars, histograms, tensorboard, wandb)
        self._last_written = iteration
        self.totals.zero_()


def _write(iteration: int, scalars: dict, histograms: dict, tensorboard, wandb) -> None:
    if tensorboard is not None:
        for tag, value in scalars.items():
            tensorboard.add_scalar(tag, value, iteration)
        for tag, values in histograms.items():
            tensorboard.add_histogram(tag, values, iteration)
    if wandb is not None:
        import wandb as wandb_lib  # a W&B writer exists only where wandb is installed

        wandb.log({**scalars, **{tag: wandb_lib.Histogram(v.numpy()) for tag, v in histograms.items()}}, iteration)
