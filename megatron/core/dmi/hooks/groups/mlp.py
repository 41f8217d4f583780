"""MLP (``mlp.*``): the layer's MLP or MoE block output, its shared expert's, and every routed
expert's output rows (``mlp.experts``).

Expert rows: the allgather token dispatcher gathers the tokens of its TP x EP group
(``tp_ep_group``) along dim 0, in group-rank order, so row ``t`` of its ``local_map`` ([gathered
tokens, local experts] bool, kept from its dispatch until the next one) is token ``t % n`` of the
group's ``t // n``-th rank, ``n`` tokens per rank. Its permutation puts the rows expert by expert,
tokens ascending within an expert: the row-major order of ``local_map.T``'s nonzeros. The experts
receive each row's routing probability (``permuted_probs``) in that order. A row's top-k slot
depends on the token's experts on every rank, so the reader derives it
(``reader.reconstruct.rebuild_expert_rows``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.hooks.groups.base import HookSite, ModelFacts, Refusal, Shards, SiteInstaller, first
from megatron.core.dmi.key import ParallelCoords

GROUP = "mlp"


def refusal(outputs: frozenset[str], facts: ModelFacts) -> Refusal | None:
    """Why the selected mlp outputs cannot be captured exactly with ``facts``, or None when they can."""
    if "mlp.experts" in outputs:
        why = experts_unsupported(facts)
        if why is not None:
            return why
    if "mlp.shared" in outputs and facts.shared_expert_overlap:
        return (
            "--dmi-hooks",
            "mlp.shared is not supported with --moe-shared-expert-overlap (the shared expert runs "
            "inside the token dispatcher there)",
        )
    return None


def experts_unsupported(facts: ModelFacts) -> Refusal | None:
    """Why ``mlp.experts`` cannot be captured exactly with ``facts``, or None when it can."""
    if facts.dispatcher not in ("allgather", "alltoall"):
        return "--moe-token-dispatcher-type", "mlp.experts needs the allgather or alltoall token dispatcher"
    if facts.tensor_parallel > 1 and not facts.sequence_parallel:
        return (
            "--sequence-parallel",
            "mlp.experts needs sequence parallelism with tensor parallelism (without it the dispatcher gathers "
            "copies of the same tokens from the TP ranks)",
        )
    if facts.capacity_factor is not None:
        return (
            "--moe-expert-capacity-factor",
            "mlp.experts does not support token dropping (a dropped route's slot needs the pre-drop order)",
        )
    if facts.latent_size is not None:
        return "--moe-latent-size", "mlp.experts does not support latent experts (their rows are not hidden vectors)"
    if facts.padding_for_quantization:
        return (
            "--moe-router-padding-for-quantization",
            "mlp.experts does not support routing padded for quantization (padding rows are not routes)",
        )
    return None


def layer_site(hooks: SiteInstaller, module: TransformerLayer, coords: ParallelCoords) -> None:
    """mlp.out from a forward hook on the layer's MLP, mlp.shared from one on its shared expert, and
    mlp.experts (see ``_watch_experts``)."""
    layer = module.layer_number - 1
    hooks.placed(layer, GROUP)
    capture = hooks.capture
    shards = Shards.of(module.config, coords)
    out_site = HookSite(capture, layer, shards, ("mlp.out",))
    shared_site = HookSite(capture, layer, shards, ("mlp.shared",))

    def hook(mlp, args, output):
        if capture.idle:
            return
        if capture.recording():
            out = first(output)
            out_site.publish(out.shape[0], (out,))

    def shared_hook(shared, args, output):
        if capture.idle:
            return
        if capture.recording():
            shared_site.publish(output.shape[0], (output,))

    if out_site.outputs:
        hooks.hold(module.mlp.register_forward_hook(hook))
    shared_experts = getattr(module.mlp, "shared_experts", None)
    if shared_experts is not None and shared_site.outputs:
        hooks.hold(shared_experts.register_forward_hook(shared_hook))
    experts = getattr(module.mlp, "experts", None)
    if "mlp.experts" in capture.config.hooks and experts is not None:
        _watch_experts(hooks, module, experts, coords)


def _watch_experts(
    hooks: SiteInstaller, module: TransformerLayer, experts: torch.nn.Module, coords: ParallelCoords
) -> None:
    """mlp.experts: every rank publishes rows no other rank publishes; a firing with no rows still
    publishes its empty record, so the record counts do not depend on the routing.

    Allgather dispatcher: the experts module's output, this rank's experts' rows for the tokens of its
    TP x EP group. Alltoall dispatcher: the rows of this rank's own tokens as the combine's
    all-to-all brings them back from every expert (expert tensor parallel partials already reduced),
    in the order this rank's permutation sent them."""
    config = module.config
    dispatcher = module.mlp.token_dispatcher
    layer = module.layer_number - 1
    capture = hooks.capture

    def publish_rows(site, rows, local_map, permuted_probs, first_expert):
        with torch.no_grad():
            record = expert_rows(rows, local_map, permuted_probs, first_expert, list(site.shards.group_ranks))
        site.publish(record.shape[0], (record,))

    if config.moe_token_dispatcher_type == "alltoall":
        token_combine = dispatcher.token_combine
        own = HookSite(capture, layer, Shards.of(config, coords, (coords.rank,)), ("mlp.experts",))
        if not own.outputs:
            return

        def combined(hidden_states, *args, **kwargs):
            rows = token_combine(hidden_states, *args, **kwargs)
            if not capture.idle and capture.recording():
                routing_map = dispatcher.routing_map
                # the probabilities in the order permute() put this rank's rows: by expert, tokens ascending
                permuted = dispatcher.probs.t().contiguous().masked_select(routing_map.t().contiguous())
                publish_rows(own, rows, routing_map, permuted, 0)
            return rows

        hooks.wrap(dispatcher, "token_combine", combined)
        return

    first_expert = dispatcher.local_expert_indices[0]
    group = dispatcher.tp_ep_group
    if torch.distributed.is_initialized() and group is not None:
        group_ranks = tuple(torch.distributed.get_process_group_ranks(group))
    else:
        group_ranks = (coords.rank,)
    gathered = HookSite(capture, layer, Shards.of(config, coords, group_ranks), ("mlp.experts",))
    if not gathered.outputs:
        return

    def hook(experts, args, output):
        if capture.idle or not capture.recording():
            return
        publish_rows(gathered, first(output), dispatcher.local_map, args[2], first_expert)

    hooks.hold(experts.register_forward_hook(hook))


def expert_rows(
    output: torch.Tensor,
    local_map: torch.Tensor,
    permuted_probs: torch.Tensor,
    first_expert: int,
    group_ranks: list[int],
) -> torch.Tensor:
    """The ``mlp.experts`` record of one forward: [rows, h + 5] fp32.

    Args:
        output: the experts' output, [rows, h], rows in the dispatcher's permuted order (a partial
            sum under expert tensor parallelism: the ETP ranks' rows add up to the row).
        local_map: the dispatcher's [gathered tokens, local experts] routing map of the same forward.
        permuted_probs: each row's routing probability, in row order (the experts' third argument).
        first_expert: global id of the first local expert.
        group_ranks: global ranks of the dispatcher's TP x EP group, in group order (the gather order).

    Returns:
        Columns 0..h-1 the rows (upcast exactly), then ``catalog.EXPERT_ROW_FIELDS``: the global expert id, the global
        rank whose token it is, the token's index among that rank's tokens, that rank's token count
        and the routing probability (fp32, exact for router dtypes up to fp32).
    """
    local_expert, token = local_map.t().nonzero(as_tuple=True)
    per_rank = local_map.shape[0] // len(group_ranks)
    ranks = torch.tensor(group_ranks, dtype=torch.long, device=local_map.device)
    fields = torch.stack(
        [
            (local_expert + first_expert).float(),
            ranks[token // per_rank].float(),
            (token % per_rank).float(),
            torch.full_like(token, per_rank).float(),
            permuted_probs.reshape(-1).float(),
        ],
        dim=1,
    )
    return torch.cat([output.float(), fields], dim=1)
