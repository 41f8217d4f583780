"""Rebuild one full tensor from the records (shards) of one (run, phase, iteration, microbatch,
layer, output, invocation), following the catalog's combine rule.

- ``concat``: every record covers tokens [token_start, token_end) of dim 0 of the full tensor
  (length token_total) and, when the output has a ``shard_dim``, shard ``shard_index`` of
  ``shard_count`` along that dim (e.g. attention heads under tensor parallelism). The token
  ranges must tile [0, token_total) exactly and every range needs every shard index.
- ``sum``: records over disjoint token ranges that tile [0, token_total) are added (e.g.
  ``router.expert_counts`` under sequence/context parallelism).
- ``topk`` and ``log_softmax``: like ``concat``, every token range needs every shard (vocabulary
  shards under tensor parallelism); the shards merge instead of concatenating: ``topk`` takes the
  k largest (value, id) pairs of their union (``logits.topk``), ``log_softmax`` combines each
  shard's (max, sum of exp, label logit) into the label's log-probability (``logits.target``).
- ``rows`` (``mlp.experts``): every rank of an expert group holds rows of other ranks' tokens, so a
  data-parallel rank's rows are gathered from every record by the rank each row names
  (``rebuild_expert_rows``).

Records with equal (token range, shard index) are duplicates: identical ones (replicated producers,
e.g. TP ranks routing the same tokens) are kept once, differing ones are an error.

The rebuild runs in numpy (``rebuild`` returns a ``Rebuilt``: the stored dtype's name and the values), so the
reading commands never import torch (about 1.6 s); ``reconstruct`` and ``Rebuilt.torch`` give torch tensors,
bitwise those of the payloads, for callers who want them.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron.core.dmi import catalog
from megatron.core.dmi.key import RecordKey
from megatron.core.dmi.reader.errors import ReconstructionError, format_ranges
from megatron.core.dmi.records import Record, array_to_tensor, payload_to_array

if TYPE_CHECKING:
    import pyarrow as pa
    import torch


@dataclass(frozen=True)
class Rebuilt:
    """A rebuilt tensor without torch: ``dtype`` its name in the store (``bfloat16``, ``int32`` ...), ``values``
    a numpy array of its values (bfloat16 widened exactly to float32: numpy has no bfloat16)."""

    dtype: str
    values: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return self.values.shape

    def torch(self) -> torch.Tensor:
        """The tensor in torch, of the stored dtype (bitwise the stored values)."""
        return array_to_tensor(self.values, self.dtype)


def records_from_table(table: pa.Table) -> list[Record]:
    """The records of a tensor table (``TENSOR_SCHEMA``'s columns), each payload checked against its crc32;
    ReconstructionError names the first that fails (a corrupted store)."""
    out = []
    for row in table.to_pylist():
        payload = bytes(row.pop("payload"))
        checksum = row.pop("checksum")
        row.pop("nbytes")
        key = RecordKey.from_flat(row)
        if zlib.crc32(payload) != checksum:
            raise ReconstructionError(
                f"{key.output} iteration {key.iteration} layer {key.layer} rank {key.coords.rank}: payload fails its "
                f"crc32 checksum (corrupted store)"
            )
        out.append(Record(key, payload))
    return out


def expected_ranks(topology: Iterable[Mapping], key: RecordKey) -> dict[int, list[int]] | None:
    """Shard index -> the ranks whose ``topology`` row (one per rank of ``key``'s attempt) holds ``key``'s layer at
    its data-parallel rank, by tensor-parallel rank: ``rebuild``'s ``expected_ranks`` (None without topology)."""
    out: dict[int, list[int]] = defaultdict(list)
    for row in topology:
        if key.layer in {int(x) for x in row["layers"]} and int(row["dp"]) == key.coords.dp:
            out[int(row["tp"])].append(int(row["rank"]))
    return dict(out) or None


def _values(record: Record) -> np.ndarray:
    return payload_to_array(record.payload, record.key.dtype, record.key.shape)


def _ranks(recs: Iterable[Record]) -> str:
    return ",".join(str(r) for r in sorted({x.key.coords.rank for x in recs}))


def _dedupe(records: Sequence[Record], what: str) -> dict[tuple[int, int, int], Record]:
    groups: dict[tuple[int, int, int], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.key.token_start, r.key.token_end, r.key.shard_index)].append(r)
    out = {}
    for k, recs in groups.items():
        first = recs[0]
        for other in recs[1:]:
            if other.key.shape != first.key.shape or other.payload != first.payload:
                raise ReconstructionError(
                    f"{what}: conflicting duplicates for tokens [{k[0]}, {k[1]}) shard {k[2]}: rank "
                    f"{first.key.coords.rank} (crc32 {zlib.crc32(first.payload):08x}, shape {list(first.key.shape)}) vs "
                    f"rank {other.key.coords.rank} (crc32 {zlib.crc32(other.payload):08x}, shape {list(other.key.shape)})"
                )
        out[k] = first
    return out


def _check_tiling(ranges: list[tuple[int, int]], total: int, what: str, by_range: dict, expected: str = "") -> None:
    pos = 0
    prev = None
    for start, end in sorted(ranges):
        if end < start:
            raise ReconstructionError(f"{what}: invalid token range [{start}, {end})")
        if start < pos:
            raise ReconstructionError(
                f"{what}: overlapping token ranges [{prev[0]}, {prev[1]}) (rank(s) {_ranks(by_range[prev])}) and "
                f"[{start}, {end}) (rank(s) {_ranks(by_range[(start, end)])})"
            )
        if start > pos:
            raise ReconstructionError(f"{what}: gap: tokens [{pos}, {start}) of {total} are missing{expected}")
        pos, prev = end, (start, end)
    if pos != total:
        raise ReconstructionError(f"{what}: gap: tokens [{pos}, {total}) of {total} are missing{expected}")


def reconstruct(
    records: Sequence[Record],
    output: str | None = None,
    *,
    what: str = "",
    expected_ranks: dict[int, list[int]] | None = None,
) -> torch.Tensor:
    """``rebuild``'s tensor in torch (imports torch)."""
    return rebuild(records, output, what=what, expected_ranks=expected_ranks).torch()


def rebuild(
    records: Sequence[Record],
    output: str | None = None,
    *,
    what: str = "",
    expected_ranks: dict[int, list[int]] | None = None,
) -> Rebuilt:
    """The full tensor from ``records`` (all of one key up to the shard fields), without torch.

    ``expected_ranks`` (optional, shard index -> ranks that should have produced it, from the
    topology table) only enriches the error messages.
    """
    if not records:
        raise ReconstructionError(f"{what or output}: no records")
    output = output or records[0].key.output
    what = what or output
    spec = catalog.BY_NAME.get(output)
    combine = spec.combine if spec else "concat"
    shard_dim = spec.shard_dim if spec else None

    for r in records:
        if len(r.payload) != r.key.nbytes:
            raise ReconstructionError(
                f"{what}: payload of rank {r.key.coords.rank} has {len(r.payload)} bytes, shape {list(r.key.shape)} "
                f"of {r.key.dtype} needs {r.key.nbytes}"
            )
    for attr in ("dtype", "token_total", "shard_count"):
        vals = {getattr(r.key, attr) for r in records}
        if len(vals) > 1:
            raise ReconstructionError(f"{what}: records disagree on {attr}: {sorted(map(str, vals))}")
    total = records[0].key.token_total
    shard_count = records[0].key.shard_count
    uniq = _dedupe(records, what)

    by_range: dict[tuple[int, int], dict[int, Record]] = defaultdict(dict)
    for (start, end, shard), r in uniq.items():
        if combine != "sum" and r.key.shape and r.key.shape[0] != end - start:
            raise ReconstructionError(
                f"{what}: rank {r.key.coords.rank} record covers tokens [{start}, {end}) but has {r.key.shape[0]} rows"
            )
        if not 0 <= shard < shard_count:
            raise ReconstructionError(
                f"{what}: shard index {shard} outside 0..{shard_count - 1} (rank {r.key.coords.rank})"
            )
        by_range[(start, end)][shard] = r

    def exp(shard: int | None = None) -> str:
        if not expected_ranks:
            return ""
        ranks = sorted({x for s, rs in expected_ranks.items() if shard is None or s == shard for x in rs})
        return f" (expected from rank(s) {','.join(map(str, ranks))})" if ranks else ""

    _check_tiling(list(by_range), total, what, {k: v.values() for k, v in by_range.items()}, exp())

    dtype = records[0].key.dtype
    if combine == "sum":
        parts = [r for rng in sorted(by_range) for r in by_range[rng].values()]
        for r in parts[1:]:
            if r.key.shape != parts[0].key.shape:
                raise ReconstructionError(
                    f"{what}: cannot sum shapes {list(parts[0].key.shape)} and {list(r.key.shape)} "
                    f"(rank {r.key.coords.rank})"
                )
        return Rebuilt(dtype, _sum([_values(r) for r in parts], dtype))

    pieces = []
    for rng in sorted(by_range):
        shards = by_range[rng]
        missing = sorted(set(range(shard_count)) - set(shards))
        if missing:
            raise ReconstructionError(
                f"{what}: tokens [{rng[0]}, {rng[1]}): shard(s) {missing} of {shard_count} missing "
                f"(present from rank(s) {_ranks(shards.values())}){exp(missing[0])}"
            )
        ts = [_values(shards[i]) for i in range(shard_count)]
        if combine in _MERGES:
            ts = [_MERGES[combine](ts)]
        elif shard_count > 1:
            if shard_dim is None:
                raise ReconstructionError(f"{what}: {shard_count} shards but output {output} has no shard dimension")
            ts = [np.concatenate(ts, axis=shard_dim)]
        pieces.append(ts[0])
    values = pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces, axis=0)
    return Rebuilt("float64" if combine == "log_softmax" else dtype, values)


def rebuild_each(records: Iterable[Record], output: str, what: str) -> dict[tuple[int, int, int, int], Rebuilt]:
    """Every tensor ``records`` hold (one output, phase and invocation of one attempt per iteration), rebuilt, by
    (iteration, microbatch, layer, data-parallel rank); ``what`` (output, run, phase) starts each one's name in
    errors."""
    groups: dict[tuple[int, int, int, int], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.key.iteration, r.key.microbatch, r.key.layer, r.key.coords.dp)].append(r)
    return {
        key: rebuild(recs, output, what=f"{what} iteration {key[0]} microbatch {key[1]} layer {key[2]} dp {key[3]}")
        for key, recs in sorted(groups.items())
    }


def _sum(parts: list[np.ndarray], dtype: str) -> np.ndarray:
    """The shards added one by one in the stored dtype (numpy rounds float16 sums as torch does); bfloat16,
    which numpy lacks, is added by torch."""
    if dtype == "bfloat16":
        acc = array_to_tensor(parts[0], dtype)
        for p in parts[1:]:
            acc += array_to_tensor(p, dtype)
        return acc.float().numpy()
    acc = parts[0].copy()
    for p in parts[1:]:
        acc += p
    return acc


def descending_order(values: np.ndarray) -> np.ndarray:
    """Indices sorting the last axis largest first, stable, NaN first (torch's descending stable sort)."""
    return np.lexsort((-values, ~np.isnan(values)), axis=-1)


def merge_topk(shards: list[np.ndarray]) -> np.ndarray:
    """[..., k, 2] (value, id) pairs of each vocabulary shard -> the k largest of their union,
    largest first, ties by the lower id (values are copied, never recomputed)."""
    k = shards[0].shape[-2]
    union = np.concatenate(shards, axis=-2)
    by_id = np.argsort(union[..., 1], axis=-1, kind="stable")
    union = np.take_along_axis(union, by_id[..., None], axis=-2)
    order = descending_order(union[..., 0])[..., :k]
    return np.take_along_axis(union, order[..., None], axis=-2)


def merge_log_softmax(shards: list[np.ndarray]) -> np.ndarray:
    """[..., 3] (max logit, sum of exp(logit - max), label logit or -inf) of each vocabulary shard ->
    [...] fp64 log-probability of the label: label logit - log(sum over shards of sum * exp(max - M)) - M."""
    parts = np.stack(shards).astype(np.float64)
    peak = parts[..., 0].max(axis=0)
    total = (parts[..., 1] * np.exp(parts[..., 0] - peak)).sum(axis=0)
    label = parts[..., 2].max(axis=0)
    return label - peak - np.log(total)


_MERGES = {"topk": merge_topk, "log_softmax": merge_log_softmax}


def rebuild_expert_rows(
    records: Sequence[Record], sources: dict[int, tuple[int, int]], dp: int, what: str = "mlp.experts"
) -> np.ndarray:
    """The ``mlp.experts`` rows of data-parallel rank ``dp``: [rows, h + 3] fp32, by expert then token.

    Args:
        records: one (iteration, microbatch, layer)'s records from every rank (hooks.experts' columns).
        sources: global rank -> (data-parallel rank, tensor-parallel rank), from the topology table.
        dp: the data-parallel rank whose tokens to rebuild.
        what: names the tensor in errors.

    Returns:
        Columns 0..h-1 the row (the partial rows of expert-tensor-parallel ranks added in their group
        order), then the expert id, the token index in the rank's router.logits order (sequence
        parallel shards in TP order) and the top-k slot: the row's place among its token's rows by
        probability, the lower expert first on ties (router.topk_ids' order).

    Raises:
        ReconstructionError: a row names a rank the topology does not know, or the tokens do not all
            have the same number of rows (a rank's records are missing).
    """
    fields = len(catalog.EXPERT_ROW_FIELDS)
    tables = [_values(r) for r in sorted(records, key=lambda r: (r.key.shard_index, r.key.coords.rank))]
    rows = np.concatenate(tables) if tables else np.zeros((0, fields), dtype=np.float32)
    hidden = rows.shape[1] - fields
    expert, source, token, per_source = rows[:, hidden : hidden + 4].astype(np.int64).T
    unknown = set(np.unique(source).tolist()) - set(sources)
    if unknown:
        raise ReconstructionError(
            f"{what}: rows name rank(s) {sorted(unknown)} that the topology does not list: the records of a rank of "
            "the expert group are missing"
        )
    lookup = np.full((max(sources, default=0) + 1, 2), -1, dtype=np.int64)
    for rank, coords in sources.items():
        lookup[rank] = coords
    mine = lookup[source, 0] == dp
    rows, expert, per_source = rows[mine], expert[mine], per_source[mine]
    token = lookup[source[mine], 1] * per_source + token[mine]
    tokens = int(token.max()) + 1 if token.size else 0
    # one output row per (expert, token): ETP ranks' partials added, in record order
    key, inverse = np.unique(expert * tokens + token, return_inverse=True)
    out = np.zeros((key.size, hidden), dtype=np.float32)
    np.add.at(out, inverse, rows[:, :hidden])
    prob = np.zeros(key.size, dtype=np.float32)
    prob[inverse] = rows[:, hidden + 4]
    expert, token = key // max(tokens, 1), key % max(tokens, 1)
    per_token = np.bincount(token, minlength=tokens)
    if per_token.size and (per_token != per_token[0]).any():
        short = np.flatnonzero(per_token != per_token.max())
        raise ReconstructionError(
            f"{what}: dp {dp}: token(s) {format_ranges(short.tolist())} of {tokens} have fewer rows than the others "
            f"({per_token.max()}): the records of a rank of the expert group are missing"
        )
    # slot: by token, then probability descending (NaN first), then expert (a stable sort, last key first)
    order = np.lexsort((-prob, ~np.isnan(prob), token))
    slot = np.empty_like(token)
    slot[order] = np.arange(key.size) % max(int(per_token.max()) if per_token.size else 1, 1)
    return np.concatenate([out, np.stack([expert, token, slot], axis=1).astype(np.float32)], axis=1)
