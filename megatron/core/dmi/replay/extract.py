"""Extract one rank's replay data from a stored run (run as a subprocess of a training rank).

    python -c "$PROGRAM" OUT.npy < request.json     # PROGRAM below; or -m megatron.core.dmi.replay.extract

Writes ``OUT.npy``, an int64 array [stored iterations, microbatches, layers, tokens, k] holding this
rank's top-k selection, and ``OUT.json`` (the iterations it holds, the source run and the iterations
it could not rebuild, with why). Any mismatch between the stored run and the request ends it with
exit status 2 and one line on stderr naming what differs.

A spool-only store (``--dmi-persist spool``: ``spool/`` and no ``chdb/``) is read straight from its
verified segments (``reader/spool.py``), so it needs no chDB; any other store through chDB or its
server (``reader/store.py``); never a mix of both. In a spool, a segment that does not verify as a
whole stops the extraction (status 2, one line naming it); an iteration that lost records to
failed checks is one the stored run cannot replay (the index names the segment), for
``--dmi-replay-missing`` to decide.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.reader.errors import ReconstructionError, StoreError
from megatron.core.dmi.replay.request import ReplayRequest, ReplaySourceError, index_path

# The subprocess's program: ``-m megatron.core.dmi.replay.extract`` would first run megatron-core's package
# ``__init__`` (torch and most of megatron-core: seconds per rank); megatron_dmi registers the package bare.
PROGRAM = (
    "import sys, megatron_dmi; megatron_dmi.register_bare_core();"
    "from megatron.core.dmi.replay.extract import main; sys.exit(main(sys.argv[1:]))"
)
# the pre-drop selection where the run recorded it, else the post-drop ids (equal without capacity dropping)
OUTPUTS = ("router.selected", "router.topk_ids")
# (stored model-summary name, what it is called in the error)
MATCHED_FACTS = (
    ("num_layers", "number of layers"),
    ("moe_layer_freq", "MoE layer pattern (--moe-layer-freq)"),
    ("num_moe_experts", "number of experts"),
    ("moe_router_topk", "top-k"),
    ("seq_length", "sequence length"),
    ("micro_batch_size", "micro batch size"),
    ("global_batch_size", "global batch size"),
)


def check_facts(stored: dict, wanted: dict, run: str) -> None:
    """Raise ReplaySourceError naming the first fact of ``MATCHED_FACTS`` that differs."""
    for name, what in MATCHED_FACTS:
        if name in wanted and stored.get(name) != wanted[name]:
            raise ReplaySourceError(f"stored run {run} has {what} {stored.get(name)!r}, this run {wanted[name]!r}")


def source_microbatch(request: ReplayRequest, microbatch: int, source_dp_size: int) -> tuple[int, int]:
    """(source microbatch, source data-parallel rank) holding this rank's ``microbatch``.

    Megatron's pretraining sampler gives each step's samples to the data-parallel ranks in
    micro-batch-sized runs: sample run ``microbatch * dp_size + dp`` of the step. Micro batch sizes
    match (checked), so one source microbatch holds exactly this microbatch's samples."""
    run_index = microbatch * request.dp_size + request.dp
    return divmod(run_index, source_dp_size)


@dataclass
class StoredRouting:
    """What extraction reads of the stored run, from either reader."""

    run: str
    model: dict
    layout: dict
    layers: dict[str, set[int]]  # output of OUTPUTS -> the layers it was recorded at in training
    iterations: list[int]  # the visible training iterations
    damaged: dict[int, str]  # training iterations some of whose records failed verification, and why
    ids: Callable[[str, int, int, int, int], np.ndarray]  # (output, iteration, microbatch, layer, dp) -> [tokens, k]


def _source_ranks(request: ReplayRequest, source_dp: int) -> tuple[set[int], set[int]]:
    """The source microbatches and data-parallel ranks that hold this rank's microbatches."""
    pairs = [source_microbatch(request, mb, source_dp) for mb in range(request.microbatches)]
    return {mb for mb, _ in pairs}, {dp for _, dp in pairs}


@contextmanager
def _from_spool(request: ReplayRequest) -> Iterator[StoredRouting]:
    """A spool-only store (``--dmi-persist spool``), read from its verified segments: no chDB."""
    from megatron.core.dmi.reader.spool import open_spool_run

    run = open_spool_run(request.store, request.run)
    microbatches, dps = _source_ranks(request, int(run.layout.get("dp", 1)))
    recs = run.read_records(
        output=OUTPUTS, phase=["train"], invocation=[0], layer=request.layers, microbatch=microbatches, dp=dps
    )
    yield StoredRouting(
        run.run_id,
        run.model,
        run.layout,
        {output: recs.layers(output) for output in OUTPUTS},
        recs.iterations(),
        {it: why for (phase, it), why in recs.damaged.items() if phase == "train"},
        lambda output, it, mb, layer, dp: recs.rebuild(output, it, mb, layer, dp=dp).values,
    )


@contextmanager
def _from_store(request: ReplayRequest) -> Iterator[StoredRouting]:
    """A chDB store directory or a server, through the reader (``open_store``)."""
    try:
        from megatron.core.dmi.reader.store import open_store

        store = open_store(request.store)
    except ImportError as exc:  # chDB, pandas or the server's client missing where the store needs it
        raise ReplaySourceError(
            f"reading the store {request.store} needs the package {exc.name or ''!r}, which this Python cannot "
            f"import ({exc}); a store written with --dmi-persist spool alone (no chdb/ in it) is read without it"
        ) from None
    with store:
        run = store.resolve_run(request.run)
        described = store.describe(run)
        train = described.outputs[described.outputs["phase"] == "train"]
        yield StoredRouting(
            run,
            described.model,
            described.layout,
            {row["output"]: {int(x) for x in row["layers"]} for _, row in train.iterrows()},
            sorted(described.iterations.get("train", [])),
            {},
            lambda output, it, mb, layer, dp: store.array(run, output, it, mb, layer, dp=dp),
        )


def stored_routing(request: ReplayRequest) -> AbstractContextManager[StoredRouting]:
    """The stored run of ``request``: a spool-only store read straight from its segments (no chDB needed), any
    other store through chDB or its server."""
    from megatron.core.dmi.reader.spool import spool_only

    return _from_spool(request) if spool_only(request.store) else _from_store(request)


def extract(request: ReplayRequest, out: str) -> dict:
    """Write this rank's replay array to ``out`` and its index beside it; returns the index."""
    try:
        with stored_routing(request) as stored:
            return _extract(request, stored, out)
    except StoreError as exc:
        raise ReplaySourceError(str(exc)) from None


def _extract(request: ReplayRequest, stored: StoredRouting, out: str) -> dict:
    run = stored.run
    check_facts(stored.model, request.facts, run)
    output = next((o for o in OUTPUTS if set(request.layers) <= stored.layers.get(o, set())), None)
    if output is None:
        stored_layers = stored.layers.get(OUTPUTS[1], set())
        missing = sorted(set(request.layers) - stored_layers)
        raise ReplaySourceError(
            f"stored run {run} has no {OUTPUTS[1]} records (record it with --dmi-hooks router)"
            if not stored_layers
            else f"stored run {run} has no {OUTPUTS[1]} for layer(s) {', '.join(map(str, missing))} "
            f"(recorded layers: {', '.join(map(str, sorted(stored_layers)))})"
        )
    source_dp = int(stored.layout.get("dp", 1))
    experts, topk = int(request.facts["num_moe_experts"]), int(request.facts["moe_router_topk"])
    tokens = int(request.facts["seq_length"]) * int(request.facts["micro_batch_size"])
    rows = tokens // request.tp_size if request.sequence_parallel else tokens
    first_row = request.tp * rows if request.sequence_parallel else 0
    # an iteration that lost records to damage is tried too: its reason is then the damage
    iterations = sorted(set(stored.iterations) | set(stored.damaged))
    data = np.zeros((len(iterations), request.microbatches, len(request.layers), rows, topk), dtype=np.int64)
    kept, unusable = [], {}
    for it in iterations:
        try:
            for mb in range(request.microbatches):
                src_mb, src_dp = source_microbatch(request, mb, source_dp)
                for j, layer in enumerate(request.layers):
                    ids = stored.ids(output, it, src_mb, layer, src_dp)
                    if tuple(ids.shape) != (tokens, topk):
                        raise ReconstructionError(f"{output} has shape {tuple(ids.shape)}, expected {(tokens, topk)}")
                    if int(ids.max()) >= experts:
                        raise ReplaySourceError(
                            f"stored run {run} dropped routes by capacity at iteration {it} layer {layer} "
                            f"({output} holds the sentinel {experts}) and did not record its pre-drop "
                            "selection (--dmi-hooks router,router.selected)"
                        )
                    data[len(kept), mb, j] = ids[first_row : first_row + rows]
        except (ReconstructionError, StoreError) as exc:
            unusable[it] = stored.damaged.get(it, str(exc))
            continue
        kept.append(it)
    np.save(out, data[: len(kept)])
    index = {"run": run, "iterations": kept, "unusable": {str(k): v for k, v in unusable.items()}}
    with open(index_path(out), "w", encoding="utf-8") as f:
        json.dump(index, f)
    return index


def main(argv: list[str]) -> int:
    """Read the request from stdin, extract into ``argv[0]``; one error line and status 2 on a mismatch."""
    request = ReplayRequest.from_json(sys.stdin.read())
    try:
        extract(request, argv[0])
    except DMIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
