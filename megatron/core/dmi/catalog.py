"""The hook catalog: the single source of truth for what DMI can capture.

Each output names its group, its shape as a function of the model config (local to one rank), its
dtype rule, and how shards of one full tensor are laid out across ranks. Argument parsing, the
hooks, the record counts, the reader's reconstruction and docs/hooks.md all derive from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from megatron.core.dmi.errors import DMIError

Combine = Literal["concat", "sum"]


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

    @property
    def router_tokens(self) -> int:
        seq = self.seq_length // self.tp if self.sequence_parallel and self.tp > 1 else self.seq_length
        return seq * self.micro_batch


@dataclass(frozen=True)
class HookOutput:
    name: str
    group: str
    shape: str  # human-readable local shape
    dtype: str  # human-readable dtype rule
    doc: str
    # How the records of one (iteration, microbatch, layer, output) combine into the full tensor:
    # "concat" places each record at [token_start, token_end) along dim 0 and at shard_index along
    # shard_dim; "sum" adds records (counts taken over disjoint token shards).
    combine: Combine = "concat"
    shard_dim: int | None = None
    opt_in: bool = False  # captured only when named explicitly (or with "all")
    # (local shape, itemsize) for a model; record sizes and counts are derived from it
    local_shape: Callable[[ModelShape], tuple[tuple[int, ...], int]] = lambda m: ((), 0)


OUTPUTS: tuple[HookOutput, ...] = (
    HookOutput(
        "router.logits", "router", "[tokens, E]", "router dtype",
        "Raw gating logits of every token for every expert, before top-k and capacity dropping.",
        local_shape=lambda m: ((m.router_tokens, m.num_experts), m.router_itemsize),
    ),
    HookOutput(
        "router.topk_ids", "router", "[tokens, k]", "int32",
        "Chosen experts per token, ordered by routing probability (ties: lower id first). A slot "
        "dropped by the capacity factor holds the sentinel E (the number of experts).",
        local_shape=lambda m: ((m.router_tokens, m.topk), 4),
    ),
    HookOutput(
        "router.topk_probs", "router", "[tokens, k]", "router dtype",
        "Routing weight of each slot of router.topk_ids; 0 for a dropped slot.",
        local_shape=lambda m: ((m.router_tokens, m.topk), m.router_itemsize),
    ),
    HookOutput(
        "router.expert_counts", "router", "[2, E]", "int32",
        "Tokens routed to each expert: row 0 before capacity dropping, row 1 after. Token shards sum.",
        combine="sum",
        local_shape=lambda m: ((2, m.num_experts), 4),
    ),
    HookOutput(
        "attn.context", "attn", "[s, b, heads_local * d]", "model dtype",
        "Core-attention output before the output projection. Tensor parallelism shards the last dim "
        "by heads.",
        shard_dim=-1,
        local_shape=lambda m: ((m.seq_length, m.micro_batch, m.heads // m.tp * m.head_dim), m.model_itemsize),
    ),
    HookOutput(
        "attn.q", "attn", "[s, b, heads_local, d]", "model dtype",
        "Query after rotary embedding (opt-in). With attn.k it rebuilds any head's attention pattern.",
        shard_dim=2, opt_in=True,
        local_shape=lambda m: ((m.seq_length, m.micro_batch, m.heads // m.tp, m.head_dim), m.model_itemsize),
    ),
    HookOutput(
        "attn.k", "attn", "[s, b, groups_local, d]", "model dtype",
        "Key after rotary embedding (opt-in); one head per query group under GQA.",
        shard_dim=2, opt_in=True,
        local_shape=lambda m: ((m.seq_length, m.micro_batch, m.query_groups // m.tp, m.head_dim), m.model_itemsize),
    ),
)

BY_NAME: dict[str, HookOutput] = {o.name: o for o in OUTPUTS}
GROUPS: dict[str, tuple[str, ...]] = {}
for _o in OUTPUTS:
    GROUPS.setdefault(_o.group, ())
    if not _o.opt_in:
        GROUPS[_o.group] += (_o.name,)


def record_bytes(output: str, model: ModelShape) -> int:
    shape, itemsize = BY_NAME[output].local_shape(model)
    n = itemsize
    for d in shape:
        n *= d
    return n


class HookSelectionError(DMIError, ValueError):
    pass


def parse_hooks(spec: str) -> frozenset[str]:
    """Resolve ``router,attn.q`` style lists into output names; ``all`` and ``none`` work too."""
    selected: set[str] = set()
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise HookSelectionError(f"empty item in hook list {spec!r}")
        if item == "none":
            continue
        if item == "all":
            selected.update(BY_NAME)
        elif item in GROUPS:
            selected.update(GROUPS[item])
        elif item in BY_NAME:
            selected.add(item)
        else:
            known = ", ".join(["all", "none", *GROUPS, *BY_NAME])
            raise HookSelectionError(f"unknown hook {item!r} (known: {known})")
    return frozenset(selected)


def outputs_of_group(group: str, selected: frozenset[str]) -> list[str]:
    return [o.name for o in OUTPUTS if o.group == group and o.name in selected]


def markdown_table() -> str:
    """The catalog as the markdown table in docs/hooks.md (a test keeps the doc in sync)."""
    lines = [
        "| output | group | local shape | dtype | shards combine by | opt-in | meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in OUTPUTS:
        how = "sum over token shards" if o.combine == "sum" else (
            "token range on dim 0" + (f", shard index on dim {o.shard_dim}" if o.shard_dim is not None else "")
        )
        lines.append(
            f"| `{o.name}` | `{o.group}` | {o.shape} | {o.dtype} | {how} | {'yes' if o.opt_in else 'no'} | {o.doc} |"
        )
    return "\n".join(lines)
