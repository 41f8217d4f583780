"""Routing difference between two recorded runs: per layer and iteration, the share of tokens whose
expert set differs (the R3 paper's routing-mismatch figure; for a replaying run and its source, 0).

    megatron-dmi routing-diff STORE_A[@RUN] STORE_B[@RUN]

Each run's ``router.topk_ids`` is read in its own subprocess (``expert_sets_of``): chDB holds one
store per process, and the two runs may sit in different stores. A spool-only store
(``--dmi-persist spool``) is read from its segments, without chDB (``reader/spool.py``). A token's expert set is its
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

    from megatron.core.dmi.reader.reconstruct import Rebuilt
    from megatron.core.dmi.reader.store import Store

OUTPUT = "router.topk_ids"
# (iteration, microbatch, layer, data-parallel rank) -> [tokens, k] expert ids, each row sorted
ExpertSets = dict[tuple[int, int, int, int], np.ndarray]


def sorted_sets(tensors: dict[tuple[int, int, int, int], Rebuilt]) -> ExpertSets:
    """Rebuilt ``router.topk_ids`` tensors with each token's ids sorted."""
    return {key: np.sort(ids.values, axis=1) for key, ids in tensors.items()}


def expert_sets(store: Store, run_id: str, phase: str = "train") -> ExpertSets:
    """Every visible ``router.topk_ids`` tensor of ``run_id`` in ``phase``, each token's ids sorted."""
    return sorted_sets(store.rebuild_each(run_id, OUTPUT, phase))


# The subprocess's program. ``-m megatron.core.dmi.reader.routing_diff`` would first run megatron-core's package
# ``__init__`` (torch and most of megatron-core: seconds per run); megatron_dmi registers the package bare.
_DUMP = (
    "import sys, megatron_dmi; megatron_dmi.register_bare_core();"
    "from megatron.core.dmi.reader.routing_diff import dump; sys.exit(dump(*sys.argv[1:4]))"
)


class ExpertSetsProcess:
    """``expert_sets`` of ``STORE[@RUN]`` read by a subprocess, which starts at once: the caller may read another
    store meanwhile (opening a store is most of the time; a process holds one chDB store at a time)."""

    def __init__(self, spec: str, phase: str = "train"):
        """Start the subprocess reading ``spec``'s expert sets in ``phase``."""
        self.spec = spec
        self._tmp = tempfile.TemporaryDirectory(prefix="dmi-routing-diff-")
        self._out = os.path.join(self._tmp.name, "sets.npz")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _DUMP, spec, self._out, phase],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def __enter__(self) -> ExpertSetsProcess:
        """The running subprocess; leaving the block stops it if it still runs."""
        return self

    def __exit__(self, *exc) -> None:
        """Stop the subprocess if it still runs (the caller failed first) and remove its output."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._proc.stderr.close()
        self._tmp.cleanup()

    def result(self) -> tuple[str, ExpertSets]:
        """(run id, expert sets), once the subprocess ends. Raises StoreError with its one-line reason."""
        with self:
            stderr = self._proc.communicate()[1]
            if self._proc.returncode != 0:
                lines = stderr.strip().splitlines() or [f"{self.spec}: status {self._proc.returncode}"]
                raise StoreError(lines[-1].removeprefix("error: "))
            with np.load(self._out) as data:
                names = [name for name in data.files if name != "run_id"]
                return str(data["run_id"]), {tuple(int(x) for x in n.split("_")): data[n] for n in names}


def expert_sets_of(spec: str, phase: str = "train") -> tuple[str, ExpertSets]:
    """(run id, expert sets) of ``STORE[@RUN]`` (the store's latest run without ``@RUN``), read in a
    subprocess. Raises StoreError with the subprocess's one-line reason."""
    return ExpertSetsProcess(spec, phase).result()


def read_expert_sets(spec: str, phase: str = "train") -> tuple[str, ExpertSets]:
    """``expert_sets_of`` read in this process: a spool-only store straight from its segments, without chDB
    (``reader/spool.py``), any other through chDB (the process then holds that store's chDB session until it
    ends); a StoreError names ``spec``."""
    from megatron.core.dmi.reader.spool import open_spool_run, spool_only

    store_path, run = parse_store_run(spec)
    try:
        if spool_only(store_path):
            spool = open_spool_run(store_path, run)
            records = spool.read_records(output=[OUTPUT], phase=[phase], invocation=[0])
            return spool.run_id, sorted_sets(records.rebuild_each(OUTPUT, phase))
        from megatron.core.dmi.reader.store import open_store

        with open_store(store_path) as store:
            run_id = store.resolve_run(run)
            return run_id, expert_sets(store, run_id, phase)
    except StoreError as exc:
        raise StoreError(f"{spec}: {exc}") from None


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


def dump(spec: str, out: str, phase: str) -> int:
    """Write ``expert_sets`` of ``STORE[@RUN]`` to the ``.npz`` file ``out`` (``ExpertSetsProcess``'s program);
    returns the exit status (2, with the reason on stderr, for a store error)."""
    try:
        run_id, sets = read_expert_sets(spec, phase)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    np.savez(out, run_id=np.array(run_id), **{"_".join(map(str, k)): v for k, v in sets.items()})
    return 0
