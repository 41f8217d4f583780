"""The hook catalog: the single source of truth for what DMI can capture.

Each output names its group, its shape as a function of the model config (local to one rank), its
dtype rule, and how shards of one full tensor are laid out across ranks. Argument parsing, the
hooks, the record counts, the reader's reconstruction and docs/hooks.md all derive from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from megatron.core.dmi.errors import DMIError

Combine = Literal["concat", "sum", "topk", "log_softmax", "rows"]
# Which transformer layers record an output: every layer, MoE layers only, MoE layers with a shared
# expert, or the model's last layer.
Scope = Literal["layer", "moe_layer", "shared_expert_layer", "last_layer"]
# Which ranks of one model replica publish a record of one (iteration, microbatch, layer):
# - "sequence": the rows are tokens; under sequence parallelism each TP rank publishes its own token
#   shard, without it every TP rank holds the same rows and TP rank 0 publishes them;
# - "tensor": every TP rank publishes its shard along ``shard_dim`` (attention heads);
# - "replicated": every TP rank holds the same full rows (the loss, computed after the vocabulary
#   all-reduces): TP rank 0 publishes them, sequence parallel or not;
# - "one": a replicated value (a weight) published by TP rank 0 of data-parallel rank 0 only;
# - "every": every rank publishes its own rows (the routed experts' rows: no rank repeats another's).
Producers = Literal["sequence", "tensor", "replicated", "one", "every"]
# The columns of an mlp.experts record after the hidden vector, in order ([rows, h + 5] fp32).
EXPERT_ROW_FIELDS = ("expert", "source_rank", "source_token", "source_tokens", "probability")


@dataclass(frozen=True)
class ModelShape:
    """What the local record shapes depend on, for one rank."""

    seq_length: int
    micro_batch: int
    num_experts: int
    topk: int
    heads: int
    query_groups: int
    head_dim: int
    tp: int = 1
    sequence_parallel: bool = False
    router_itemsize: int = 4
    model_itemsize: int = 4
    hidden: int = 0
    vocab: int = 0  # padded vocabulary (all TP shards)
    logits_topk: int = 8
    qk_head_dim: int = 0  # per-head query/key width where it differs from head_dim (multi-latent attention)
    v_head_dim: int = 0  # per-head value (context) width where it differs from head_dim (multi-latent attention)
    residual_itemsize: int = 0  # the residual stream's element size where it differs (--fp32-residual-connection)

    @property
    def q_dim(self) -> int:
        """Per-head query/key width: ``qk_head_dim`` where set, else ``head_dim``."""
        return self.qk_head_dim or self.head_dim

    @property
    def v_dim(self) -> int:
        """Per-head value width: ``v_head_dim`` where set, else ``head_dim``."""
        return self.v_head_dim or self.head_dim

    @property
    def seq_local(self) -> int:
        """Sequence positions on this rank (its shard under sequence parallelism)."""
        return self.seq_length // self.tp if self.sequence_parallel and self.tp > 1 else self.seq_length

    @property
    def router_tokens(self) -> int:
        """Tokens the router sees per microbatch on this rank: local sequence positions times the micro batch."""
        return self.seq_local * self.micro_batch


@dataclass(frozen=True)
class HookOutput:
    """One capturable output: its group, shape and dtype rules, how its shards combine, where it is recorded."""

    name: str
    group: str
    shape: str  # human-readable local shape
    dtype: str  # human-readable dtype rule
    doc: str
    # How the records of one (iteration, microbatch, layer, output) combine into the full tensor:
    # "concat" places each record at [token_start, token_end) along dim 0 and at shard_index along
    # shard_dim; "sum" adds records (counts taken over disjoint token shards); "topk"/"log_softmax"
    # merge vocabulary shards; "rows" gathers a data-parallel rank's rows from every rank's record
    # (reader.reconstruct.rebuild_expert_rows).
    combine: Combine = "concat"
    shard_dim: int | None = None
    opt_in: bool = False  # captured only when named explicitly (or with "all")
    in_all: bool = True  # False: "all" does not select it (its name, or its group unless opt_in, does)
    scope: Scope = "layer"
    producers: Producers = "sequence"
    per_microbatch: bool = True  # False: once per captured (phase, iteration), at microbatch 0
    # True: a gradient, recorded when the backward pass computes it, under the step fields of the forward
    # that made the tensor; training steps only (evaluation runs no backward)
    backward: bool = False
    # (local shape, itemsize) for a model; record sizes and counts are derived from it
    local_shape: Callable[[ModelShape], tuple[tuple[int, ...], int]] = lambda m: ((), 0)


def _hidden_per_token(m: ModelShape) -> tuple[tuple[int, ...], int]:
    """[s_local, b, h] in the model dtype: a sub-layer's output on one rank."""
    return (m.seq_local, m.micro_batch, m.hidden), m.model_itemsize


def _residual_stream(m: ModelShape) -> tuple[tuple[int, ...], int]:
    """[s_local, b, h] in the residual dtype: the residual stream between layers on one rank."""
    return (m.seq_local, m.micro_batch, m.hidden), m.residual_itemsize or m.model_itemsize


def _router_scores(m: ModelShape) -> tuple[tuple[int, ...], int]:
    """[tokens, E] in the router dtype: one score per token and expert."""
    return (m.router_tokens, m.num_experts), m.router_itemsize


def _attention_context(m: ModelShape) -> tuple[tuple[int, ...], int]:
    """[s, b, heads_local * d] in the model dtype: this rank's heads of the core-attention output."""
    return (m.seq_length, m.micro_batch, m.heads // m.tp * m.v_dim), m.model_itemsize


OUTPUTS: tuple[HookOutput, ...] = (
    HookOutput(
        "router.logits",
        "router",
        "[tokens, E]",
        "router dtype",
        "Raw gating logits of every token for every expert, before top-k and capacity dropping.",
        scope="moe_layer",
        local_shape=_router_scores,
    ),
    HookOutput(
        "router.topk_ids",
        "router",
        "[tokens, k]",
        "int32",
        "Chosen experts per token, ordered by routing probability (ties: lower id first). A slot "
        "dropped by the capacity factor holds the sentinel E (the number of experts).",
        scope="moe_layer",
        local_shape=lambda m: ((m.router_tokens, m.topk), 4),
    ),
    HookOutput(
        "router.selected",
        "router",
        "[tokens, k]",
        "int32",
        "The router's own top-k selection before capacity dropping (opt-in): router.topk_ids without "
        "sentinels, in the same slot order; equal to it without a capacity factor. What --dmi-replay-routing "
        "replays from a run recorded with --moe-expert-capacity-factor.",
        scope="moe_layer",
        opt_in=True,
        local_shape=lambda m: ((m.router_tokens, m.topk), 4),
    ),
    HookOutput(
        "router.topk_probs",
        "router",
        "[tokens, k]",
        "router dtype",
        "Routing weight of each slot of router.topk_ids; 0 for a dropped slot.",
        scope="moe_layer",
        local_shape=lambda m: ((m.router_tokens, m.topk), m.router_itemsize),
    ),
    HookOutput(
        "router.expert_counts",
        "router",
        "[2, E]",
        "int32",
        "Tokens routed to each expert: row 0 before capacity dropping, row 1 after. Token shards sum.",
        combine="sum",
        scope="moe_layer",
        local_shape=lambda m: ((2, m.num_experts), 4),
    ),
    HookOutput(
        "attn.context",
        "attn",
        "[s, b, heads_local * d]",
        "model dtype",
        "Core-attention output before the output projection. Tensor parallelism shards the last dim by heads.",
        shard_dim=-1,
        producers="tensor",
        local_shape=_attention_context,
    ),
    HookOutput(
        "attn.q",
        "attn",
        "[s, b, heads_local, d]",
        "model dtype",
        "Query after rotary embedding (opt-in). With attn.k it rebuilds any head's attention pattern.",
        shard_dim=2,
        opt_in=True,
        producers="tensor",
        local_shape=lambda m: ((m.seq_length, m.micro_batch, m.heads // m.tp, m.q_dim), m.model_itemsize),
    ),
    HookOutput(
        "attn.k",
        "attn",
        "[s, b, groups_local, d]",
        "model dtype",
        "Key after rotary embedding (opt-in); one head per query group under GQA.",
        shard_dim=2,
        opt_in=True,
        producers="tensor",
        local_shape=lambda m: ((m.seq_length, m.micro_batch, m.query_groups // m.tp, m.q_dim), m.model_itemsize),
    ),
    HookOutput(
        "attn.out",
        "attn",
        "[s_local, b, h]",
        "model dtype",
        "Output of the layer's self-attention block (after the output projection, before its bias and the "
        "residual add; opt-in): the attention's contribution to the residual stream, so resid.in of the next "
        "layer is resid.in + attn.out + mlp.out (plus biases). Sequence parallelism shards dim 0 over TP ranks.",
        opt_in=True,
        local_shape=_hidden_per_token,
    ),
    HookOutput(
        "resid.in",
        "resid",
        "[s_local, b, h]",
        "residual dtype",
        "Hidden states entering the transformer layer (the residual stream before its input norm); "
        "layer 0's is the embedding output. Sequence parallelism shards dim 0 over TP ranks.",
        local_shape=_residual_stream,
    ),
    HookOutput(
        "resid.out",
        "resid",
        "[s_local, b, h]",
        "residual dtype",
        "Output of the model's last transformer layer, before the final norm (recorded under that "
        "layer's number). Sequence parallelism shards dim 0 over TP ranks.",
        scope="last_layer",
        local_shape=_residual_stream,
    ),
    HookOutput(
        "router.weight",
        "resid",
        "[E, h]",
        "model dtype",
        "The router's weight matrix as used by the iteration's forward, once per captured iteration "
        "(microbatch 0, published by TP rank 0 of DP rank 0: every other rank holds the same "
        "values). With resid.in it lets routing be predicted from the store alone.",
        scope="moe_layer",
        producers="one",
        per_microbatch=False,
        local_shape=lambda m: ((m.num_experts, m.hidden), m.model_itemsize),
    ),
    HookOutput(
        "mlp.out",
        "mlp",
        "[s_local, b, h]",
        "model dtype",
        "Output of the layer's MLP or MoE block (shared expert included) in token order, before its "
        "bias and the residual add. Sequence parallelism shards dim 0 over TP ranks.",
        local_shape=_hidden_per_token,
    ),
    HookOutput(
        "mlp.shared",
        "mlp",
        "[s_local, b, h]",
        "model dtype",
        "Output of the MoE layer's shared expert (its gate applied, with --moe-shared-expert-gate), "
        "which mlp.out includes. Sequence parallelism shards dim 0 over TP ranks. Refused with "
        "--moe-shared-expert-overlap (the shared expert then runs inside the token dispatcher).",
        scope="shared_expert_layer",
        local_shape=_hidden_per_token,
    ),
    HookOutput(
        "mlp.experts",
        "mlp",
        "[rows, h + 5]",
        "fp32",
        "Every routed expert's output row for a token (named explicitly only: tokens x k rows per microbatch over "
        "the ranks), by expert, tokens ascending: with the allgather dispatcher a rank records its experts' rows "
        "for its TP x EP group's tokens (partial sums under expert tensor parallelism), with the alltoall "
        "dispatcher a rank records its own tokens' rows as the combine brings them back. Columns 0..h-1: the "
        "output, upcast exactly, with the routing probability already applied; then the expert id, the global rank "
        "whose token it is, the token's index there, that rank's token count and the routing probability. The reader rebuilds a data-parallel rank's rows from every rank "
        "of its expert group as [rows, h + 3]: the row (ETP partials added), the expert id, the token index (the "
        "row of router.logits) and the top-k slot (router.topk_ids[token, slot] is the expert); a token's rows sum "
        "to mlp.out minus mlp.shared (see Conventions). Allgather or alltoall dispatcher, no capacity factor.",
        combine="rows",
        opt_in=True,
        in_all=False,
        scope="moe_layer",
        producers="every",
        # per rank: its tokens' rows (alltoall), or the mean over an expert group's ranks (allgather)
        local_shape=lambda m: ((m.router_tokens * m.topk, m.hidden + 5), 4),
    ),
    HookOutput(
        "loss.token",
        "loss",
        "[s, b, 2]",
        "fp32",
        "Per-token language-model loss before any reduction, as megatron-core's "
        "compute_language_model_loss returns it (column 0), and the loss mask the step weights it with "
        "(column 1; NaN when the forward step passes no loss_mask to the model). Recorded under the last "
        "layer's number, on the last pipeline stage.",
        scope="last_layer",
        producers="replicated",
        local_shape=lambda m: ((m.seq_length, m.micro_batch, 2), 4),
    ),
    HookOutput(
        "logits.topk",
        "logits",
        "[s, b, k, 2]",
        "fp32",
        "The k largest output logits of each token (k = --dmi-logits-topk) as (value, vocabulary id) "
        "pairs, ids exact below 2^24. Each TP rank publishes the top-k of its vocabulary shard; the reader "
        "returns the top-k of their union, largest first (ties: lower id), values bitwise as computed.",
        combine="topk",
        producers="tensor",
        scope="last_layer",
        local_shape=lambda m: ((m.seq_length, m.micro_batch, m.logits_topk, 2), 4),
    ),
    HookOutput(
        "logits.target",
        "logits",
        "[s, b, 3]",
        "fp32",
        "Log-probability of each token's label under the output logits (padded vocabulary included, as "
        "in the loss). Each TP rank publishes its vocabulary shard's (max logit, sum of exp(logit - max), "
        "label logit or -inf); the reader merges them into [s, b] fp64 log-probabilities.",
        combine="log_softmax",
        producers="tensor",
        scope="last_layer",
        local_shape=lambda m: ((m.seq_length, m.micro_batch, 3), 4),
    ),
    HookOutput(
        "logits.full",
        "logits",
        "[s, b, vocab / TP]",
        "model dtype",
        "Every output logit (named explicitly only, not by all: s x b x vocab values per microbatch; "
        "start-up prints the size). "
        "Tensor parallelism shards the vocabulary (last dim).",
        shard_dim=-1,
        producers="tensor",
        scope="last_layer",
        opt_in=True,
        in_all=False,
        local_shape=lambda m: ((m.seq_length, m.micro_batch, m.vocab // m.tp), m.model_itemsize),
    ),
    HookOutput(
        "grad.router_logits",
        "grad",
        "[tokens, E]",
        "router dtype",
        "Gradient of the loss with respect to router.logits (the routing step's input, so the gradients of "
        "the z-loss and the load-balancing losses are included), as the backward pass computes it. "
        "Sequence parallelism shards tokens over TP ranks.",
        scope="moe_layer",
        in_all=False,
        backward=True,
        local_shape=_router_scores,
    ),
    HookOutput(
        "grad.attn_context",
        "grad",
        "[s, b, heads_local * d]",
        "model dtype",
        "Gradient of the loss with respect to attn.context (the core-attention output), as the backward "
        "pass computes it. Tensor parallelism shards the last dim by heads.",
        shard_dim=-1,
        producers="tensor",
        in_all=False,
        backward=True,
        local_shape=_attention_context,
    ),
    HookOutput(
        "grad.resid_in",
        "grad",
        "[s_local, b, h]",
        "residual dtype",
        "Gradient of the loss with respect to resid.in (the transformer layer's input, through the residual "
        "path and the layer together), as the backward pass computes it. Sequence parallelism shards dim 0 "
        "over TP ranks.",
        in_all=False,
        backward=True,
        local_shape=_residual_stream,
    ),
)

BY_NAME: dict[str, HookOutput] = {o.name: o for o in OUTPUTS}
GROUPS: dict[str, tuple[str, ...]] = {}
for _o in OUTPUTS:
    GROUPS.setdefault(_o.group, ())
    if not _o.opt_in:
        GROUPS[_o.group] += (_o.name,)


def record_bytes(output: str, model: ModelShape) -> int:
    """Bytes of one record of ``output`` on one rank for ``model``."""
    shape, itemsize = BY_NAME[output].local_shape(model)
    n = itemsize
    for d in shape:
        n *= d
    return n


def producers_per_replica(output: str, tp: int, sequence_parallel: bool, dp_rank0: bool = True) -> int:
    """Ranks of one model replica (a TP group) that publish a record of ``output`` per firing;
    ``dp_rank0`` says whether the replica is data-parallel rank 0 (the only one publishing "one")."""
    producers = BY_NAME[output].producers
    if producers == "one":
        return 1 if dp_rank0 else 0
    if producers == "replicated":
        return 1
    if producers in ("tensor", "every") or (sequence_parallel and tp > 1):
        return tp
    return 1


def layers_in_scope(
    output: str, layers: list[int], num_layers: int, moe_layers: set[int], shared_expert_layers: set[int] = frozenset()
) -> list[int]:
    """The selected global layers that record ``output``."""
    scope = BY_NAME[output].scope
    if scope == "moe_layer":
        return [layer for layer in layers if layer in moe_layers]
    if scope == "shared_expert_layer":
        return [layer for layer in layers if layer in shared_expert_layers]
    if scope == "last_layer":
        return [layer for layer in layers if layer == num_layers - 1]
    return list(layers)


class HookSelectionError(DMIError, ValueError):
    """A hook list names an unknown output or group, or has an empty item."""


def parse_hooks(spec: str | Iterable[str]) -> frozenset[str]:
    """Resolve ``router,attn.q`` style lists (or an iterable of their items) into output names;
    ``all`` (every output but the named-only ones) and ``none`` work too."""
    selected: set[str] = set()
    for item in (s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)):
        if not item:
            raise HookSelectionError(f"empty item in hook list {spec!r}")
        if item == "none":
            continue
        if item == "all":
            selected.update(o.name for o in OUTPUTS if o.in_all)
        elif item in GROUPS:
            selected.update(GROUPS[item])
        elif item in BY_NAME:
            selected.add(item)
        else:
            import difflib

            names = ["all", "none", *GROUPS, *BY_NAME]
            near = difflib.get_close_matches(item, names, n=1)
            hint = f": did you mean {near[0]!r}?" if near else ""
            raise HookSelectionError(f"unknown hook {item!r}{hint} (known: {', '.join(names)})")
    return frozenset(selected)


class UnsupportedUnderGraphsError(DMIError, ValueError):
    """Selected outputs that cannot be captured when the model replays from CUDA graphs."""


def check_graph_support(hooks: frozenset[str]) -> None:
    """Refuse under CUDA graphs the backward outputs (group ``grad``): their tensor hooks are Python
    callbacks that a graph replay of the backward pass never runs; and outputs whose record size
    depends on the data (``mlp.experts``: rows per routing), which a graph's fixed shapes cannot hold."""
    backward = sorted(o for o in hooks if BY_NAME[o].backward)
    if backward:
        raise UnsupportedUnderGraphsError(
            f"{', '.join(backward)} cannot be captured under CUDA graphs (--cuda-graph-impl): they are "
            "recorded by tensor hooks in the backward pass, which a graph replay does not run; capture them in "
            "a run without CUDA graphs"
        )
    data_sized = sorted(o for o in hooks if BY_NAME[o].combine == "rows")
    if data_sized:
        raise UnsupportedUnderGraphsError(
            f"{', '.join(data_sized)} cannot be captured under CUDA graphs (--cuda-graph-impl): its row count "
            "depends on the routing, and a graph replays fixed shapes; capture it in a run without CUDA graphs"
        )


def outputs_of_group(group: str, selected: frozenset[str]) -> list[str]:
    """The outputs of ``group`` that are among ``selected``, in catalog order."""
    return [o.name for o in OUTPUTS if o.group == group and o.name in selected]


_PUBLISHED_BY = {
    "sequence": "every TP rank with SP, else TP rank 0",
    "tensor": "every TP rank",
    "replicated": "TP rank 0",
    "one": "TP rank 0 of DP rank 0",
    "every": "every rank (its own experts' rows)",
}
_SCOPE = {
    "layer": "every layer",
    "moe_layer": "MoE layers",
    "shared_expert_layer": "MoE layers with a shared expert",
    "last_layer": "last layer",
}
# (opt_in, in_all) -> the "opt-in" column: how a user selects the output beyond its group
_OPT_IN_TEXT = {
    (False, True): "no",
    (True, True): "yes",
    (True, False): "named only",
    (False, False): "group or name, not all",
}


def opt_in_text(output: HookOutput) -> str:
    """How ``output`` is selected: "no" (by its group and all), "yes" (by name or all), "named
    only", or "group or name, not all"."""
    return _OPT_IN_TEXT[(output.opt_in, output.in_all)]


_COMBINE_TEXT = {
    "sum": "sum over token shards",
    "topk": "top-k of the vocabulary shards' union",
    "log_softmax": "log-softmax merged from the vocabulary shards' partials",
    "rows": "a DP rank's rows gathered from its expert group's records, ETP partials added",
}

# Reference models for the sizes table of docs/hooks.md: the functional tests' tiny MoE (fp32) and a
# large bf16 MoE (hidden 4096, 64 experts, top-8, 32 heads of 128, vocabulary 131072, 4096 tokens per
# microbatch); logits.topk at the default k = 8.
SIZE_MODELS = {
    "tiny (fp32)": ModelShape(
        seq_length=32, micro_batch=2, num_experts=4, topk=2, heads=4, query_groups=4, head_dim=16, hidden=64, vocab=128
    ),
    "large (bf16)": ModelShape(
        seq_length=4096,
        micro_batch=1,
        num_experts=64,
        topk=8,
        heads=32,
        query_groups=8,
        head_dim=128,
        hidden=4096,
        vocab=131072,
        router_itemsize=4,
        model_itemsize=2,
    ),
}


def size_per_token(output: str, model: ModelShape) -> float:
    """Bytes one layer's record of ``output`` costs per token of a microbatch on one TP rank
    (a once-per-iteration output: its whole record, not per token)."""
    n = record_bytes(output, model)
    return n if not BY_NAME[output].per_microbatch else n / model.router_tokens


def markdown_table() -> str:
    """The catalog as the markdown tables in docs/hooks.md (a test keeps the doc in sync)."""
    lines = [
        "| output | group | local shape | dtype | shards combine by | recorded at | published by | opt-in | meaning |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in OUTPUTS:
        how = _COMBINE_TEXT.get(o.combine) or (
            "token range on dim 0" + (f", shard index on dim {o.shard_dim}" if o.shard_dim is not None else "")
        )
        when = _SCOPE[o.scope] + ("" if o.per_microbatch else ", once per iteration")
        when += ", in backward (training steps)" if o.backward else ""
        lines.append(
            f"| `{o.name}` | `{o.group}` | {o.shape} | {o.dtype} | {how} | {when} | {_PUBLISHED_BY[o.producers]} "
            f"| {opt_in_text(o)} | {o.doc} |"
        )
    lines += [
        "",
        (
            "Bytes per token per layer of one TP rank (TP = 1 below); a once-per-iteration output gives "
            "its whole record:"
        ),
        "",
        "| output | " + " | ".join(SIZE_MODELS) + " |",
        "|---|" + "---|" * len(SIZE_MODELS),
    ]
    for o in OUTPUTS:
        cells = []
        for model in SIZE_MODELS.values():
            size = size_per_token(o.name, model)
            text = f"{size:,.2f}".rstrip("0").rstrip(".")
            cells.append(f"{text} per iteration" if not o.per_microbatch else text)
        lines.append(f"| `{o.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
