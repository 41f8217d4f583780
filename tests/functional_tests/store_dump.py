"""Read a DMI store in its own process (chDB allows one store per process) and dump what tests
compare: every stored row's key (with producer coordinates and checksum), the runs and topology
tables, and every full tensor rebuilt by the reader (or the reader's error for it).

    python tests/functional_tests/store_dump.py <store_dir> <out.pt> [--load <spool_dir>] [--no-tensors]

``--load`` first loads spool segments from another directory (``--dmi-persist spool`` output, as
``python -m megatron.core.dmi load`` does).
"""

import argparse
import zlib

import torch

from megatron.core.dmi.reader import ReconstructionError, StoreError, open_store
from megatron.core.dmi.records import KEY_COLUMNS

# A stored row's key less its run (the dump names the run once), and its checksum.
ROW_COLUMNS = [name for name, _ in KEY_COLUMNS if name != "run_id"] + ["checksum"]


def tensor_crc(t: torch.Tensor) -> int:
    t = t.detach().contiguous()
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def tensor_stats(t: torch.Tensor) -> list[float]:
    """[mean, root mean square, weighted mean] of a tensor's finite values in float64 (NaN-marked
    entries left out): what a golden compares when the bits differ on another processor
    (``runner.compare``). The weights are fixed pseudo-random values in [-0.5, 0.5) by flat index, so values
    in the wrong places change the third number even where the first two stay."""
    x = t.detach().double().reshape(-1)
    weights = (torch.arange(x.numel(), dtype=torch.float64) * 7919 % 1000) / 1000 - 0.5
    keep = x.isfinite()
    x, weights = x[keep], weights[keep]
    if not x.numel():
        return [0.0, 0.0, 0.0]
    return [float(f"{v.item():.9g}") for v in (x.mean(), x.square().mean().sqrt(), (x * weights).mean())]


def dump(store_dir: str, load: str | None = None, tensors: bool = True) -> dict:
    store = open_store(store_dir, writable=bool(load))  # loading writes the store; reading takes a snapshot
    try:
        if load:
            store.load(load)
        runs = store.runs()
        run_id = store.resolve_run(None)
        vis = store.visible_attempts(run_id)
        rows = store.sql(
            f"SELECT {', '.join(ROW_COLUMNS)} FROM {store.t('tensors')} FINAL WHERE run_id = {{run:String}} "
            "ORDER BY phase, iteration, attempt, microbatch, layer, output, rank",
            {"run": run_id},
        ).to_pylist()
        for r in rows:
            r["visible"] = vis.get((r["phase"], r["iteration"])) == r["attempt"]
        out = {
            "run_id": run_id,
            "runs": runs.to_dict("records"),
            "rows": rows,
            "attempts": store.attempts(run_id).to_dict("records"),
            "topology": store.topology(run_id).to_dict("records"),
            "tensors": {},
            "errors": {},
        }
        if tensors:
            for r in rows:
                if not r["visible"]:
                    continue
                k = (r["phase"], r["iteration"], r["microbatch"], r["layer"], r["output"], r["invocation"], r["dp"])
                if k in out["tensors"] or k in out["errors"]:
                    continue
                try:
                    out["tensors"][k] = store.tensor(
                        run_id,
                        r["output"],
                        r["iteration"],
                        r["microbatch"],
                        r["layer"],
                        phase=r["phase"],
                        dp=r["dp"],
                        invocation=r["invocation"],
                    )
                except (ReconstructionError, StoreError) as exc:
                    out["errors"][k] = str(exc)
        return out
    finally:
        store.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("--load", default=None)
    p.add_argument("--no-tensors", action="store_true")
    a = p.parse_args()
    torch.save(dump(a.store, a.load, not a.no_tensors), a.out)
