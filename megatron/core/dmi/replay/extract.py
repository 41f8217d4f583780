"""Extract one rank's replay data from a stored run (run as a subprocess of a training rank).

    python -m megatron.core.dmi.replay.extract OUT.npy < request.json

Writes ``OUT.npy``, an int64 array [stored iterations, microbatches, layers, tokens, k] holding this
rank's top-k selection, and ``OUT.json`` (the iterations it holds, the source run and the iterations
it could not rebuild, with why). Any mismatch between the stored run and the request ends it with
exit status 2 and one line on stderr naming what differs.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.replay.request import ReplayRequest, ReplaySourceError, index_path

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


def extract(request: ReplayRequest, out: str) -> dict:
    """Write this rank's replay array to ``out`` and its index beside it; returns the index."""
    from megatron.core.dmi.reader.errors import ReconstructionError, StoreError
    from megatron.core.dmi.reader.store import open_store

    try:
        store = open_store(request.store)
    except StoreError as exc:
        raise ReplaySourceError(str(exc)) from None
    with store:
        try:
            run = store.resolve_run(request.run)
        except StoreError as exc:
            raise ReplaySourceError(str(exc)) from None
        described = store.describe(run)
        check_facts(described.model, request.facts, run)
        train = described.outputs[described.outputs["phase"] == "train"]
        layers_of = {row["output"]: {int(x) for x in row["layers"]} for _, row in train.iterrows()}
        output = next((o for o in OUTPUTS if set(request.layers) <= layers_of.get(o, set())), None)
        if output is None:
            stored_layers = layers_of.get(OUTPUTS[1], set())
            missing = sorted(set(request.layers) - stored_layers)
            raise ReplaySourceError(
                f"stored run {run} has no {OUTPUTS[1]} records (record it with --dmi-hooks router)"
                if not stored_layers
                else f"stored run {run} has no {OUTPUTS[1]} for layer(s) {', '.join(map(str, missing))} "
                f"(recorded layers: {', '.join(map(str, sorted(stored_layers)))})"
            )
        source_dp = int(described.layout.get("dp", 1))
        experts, topk = int(request.facts["num_moe_experts"]), int(request.facts["moe_router_topk"])
        tokens = int(request.facts["seq_length"]) * int(request.facts["micro_batch_size"])
        rows = tokens // request.tp_size if request.sequence_parallel else tokens
        first_row = request.tp * rows if request.sequence_parallel else 0
        iterations = sorted(described.iterations.get("train", []))
        data = np.zeros((len(iterations), request.microbatches, len(request.layers), rows, topk), dtype=np.int64)
        kept, unusable = [], {}
        for it in iterations:
            try:
                for mb in range(request.microbatches):
                    src_mb, src_dp = source_microbatch(request, mb, source_dp)
                    for j, layer in enumerate(request.layers):
                        ids = store.tensor(run, output, it, src_mb, layer, dp=src_dp)
                        if tuple(ids.shape) != (tokens, topk):
                            raise ReconstructionError(
                                f"{output} has shape {tuple(ids.shape)}, expected {(tokens, topk)}"
                            )
                        if int(ids.max()) >= experts:
                            raise ReplaySourceError(
                                f"stored run {run} dropped routes by capacity at iteration {it} layer {layer} "
                                f"({output} holds the sentinel {experts}) and did not record its pre-drop "
                                "selection (--dmi-hooks router,router.selected)"
                            )
                        data[len(kept), mb, j] = ids[first_row : first_row + rows].numpy()
            except (ReconstructionError, StoreError) as exc:
                unusable[it] = str(exc)
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
