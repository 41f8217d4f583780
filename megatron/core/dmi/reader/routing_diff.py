"""Routing difference between two recorded runs: per layer and iteration, the share of tokens whose
expert set differs (the R3 paper's routing-mismatch figure; for a replaying run and its source, 0).

    megatron-dmi routing-diff STORE_A[@RUN] STORE_B[@RUN]

Each run's ``router.topk_ids`` is read in its own subprocess (``expert_sets_of``): chDB holds one
store per process, and the two runs may sit in different stores. A token's expert set is its
top-k ids as a set (slot order ignored; a capacity-dropped slot counts as the sentinel E).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from megatron.core.dmi.reader.errors import StoreError
from megatron.core.dmi.store_address import parse_store_run

if TYPE_CHECKING:
    import pandas as pd

    from megatron.core.dmi.reader.store import Store

OUTPUT = "router.topk_ids"
# (iteration, microbatch, layer, data-parallel rank) -> [tokens, k] expert ids, each row sorted
ExpertSets = dict[tuple[int, int, int, int], np.ndarray]


def expert_sets(store: Store, run_id: str, phase: str = "train") -> ExpertSets:
    """Every visible ``router.topk_ids`` tensor of ``run_id`` in ``phase``, each token's ids sorted."""
    from megatron.core.dmi.reader.store import _VISIBLE

    keys = store.sql(
        f"SELECT DISTINCT iteration, microbatch, layer, dp FROM {store.t('tensors')} FINAL "
        f"WHERE run_id = {{run:String}} AND output = '{OUTPUT}' AND phase = {{phase:String}} AND invocation = 0 "
        f"AND {_VISIBLE} ORDER BY iteration, microbatch, layer, dp",
        {**store._vis_params(run_id), "phase": phase},
    ).to_pylist()
    out = {}
    for k in keys:
        key = (int(k["iteration"]), int(k["microbatch"]), int(k["layer"]), int(k["dp"]))
        ids = store.tensor(run_id, OUTPUT, key[0], key[1], key[2], phase=phase, dp=key[3])
        out[key] = np.sort(ids.numpy(), axis=1)
    return out


def expert_sets_of(spec: str, phase: str = "train") -> tuple[str, ExpertSets]:
    """(run id, expert sets) of ``STORE[@RUN]`` (the store's latest run without ``@RUN``), read in a
    subprocess. Raises StoreError with the subprocess's one-line reason."""
    with tempfile.TemporaryDirectory(prefix="dmi-routing-diff-") as tmp:
        out = os.path.join(tmp, "sets.npz")
        proc = subprocess.run(
            [sys.executable, "-m", "megatron.core.dmi.reader.routing_diff", spec, out, phase],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"status {proc.returncode}"]
            raise StoreError(f"{spec}: {lines[-1].removeprefix('error: ')}")
        with np.load(out) as data:
            run_id = str(data["run_id"])
            sets = {tuple(int(x) for x in name.split("_")): data[name] for name in data.files if name != "run_id"}
    return run_id, sets


def routing_diff(a: ExpertSets, b: ExpertSets) -> pd.DataFrame:
    """Per (layer, iteration) over the microbatches and data-parallel ranks both runs hold: tokens,
    tokens whose expert set differs, and their share. Raises StoreError when they share none."""
    import pandas as pd

    rows: dict[tuple[int, int], list[int]] = {}
    for key in sorted(a.keys() & b.keys(), key=lambda k: (k[2], k[0], k[1], k[3])):
        if a[key].shape != b[key].shape:
            raise StoreError(f"{OUTPUT} iteration {key[0]} layer {key[2]}: shapes {a[key].shape} and {b[key].shape}")
        counts = rows.setdefault((key[2], key[0]), [0, 0])
        counts[0] += a[key].shape[0]
        counts[1] += int((a[key] != b[key]).any(axis=1).sum())
    if not rows:
        raise StoreError(f"the two runs hold no {OUTPUT} of a common iteration, microbatch and layer")
    df = pd.DataFrame(
        [(layer, it, n, d) for (layer, it), (n, d) in rows.items()],
        columns=["layer", "iteration", "tokens", "differing"],
    )
    df["share"] = df["differing"] / df["tokens"]
    return df


def _dump(spec: str, out: str, phase: str) -> int:
    from megatron.core.dmi.reader.store import open_store

    store_path, run = parse_store_run(spec)
    try:
        with open_store(store_path) as store:
            run_id = store.resolve_run(run)
            sets = expert_sets(store, run_id, phase)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    np.savez(out, run_id=np.array(run_id), **{"_".join(map(str, k)): v for k, v in sets.items()})
    return 0


if __name__ == "__main__":
    sys.exit(_dump(*sys.argv[1:4]))
