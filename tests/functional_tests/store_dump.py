"""Read a DMI store in its own process (chDB allows one store per process) and dump what tests
compare: record counts per output and every record of a run, as torch tensors.

    python tests/functional_tests/store_dump.py <store_dir> <out.pt>
"""

import sys

import torch

from megatron.core.dmi.reader import open_store


def dump(store_dir: str) -> dict:
    store = open_store(store_dir)
    try:
        runs = store.runs()
        run_id = store.resolve_run(None)
        rows = store.sql(
            f"SELECT phase, iteration, microbatch, layer, output, invocation, attempt, rank FROM {store.t('tensors')} FINAL "
            "WHERE run_id = {run:String} ORDER BY iteration, microbatch, layer, output, rank",
            {"run": run_id},
        ).to_pylist()
        tensors = {}
        for r in rows:
            k = (r["phase"], r["iteration"], r["microbatch"], r["layer"], r["output"], r["invocation"])
            if k not in tensors:
                tensors[k] = store.tensor(run_id, r["output"], r["iteration"], r["microbatch"], r["layer"],
                                          phase=r["phase"], invocation=r["invocation"])
        return {"run_id": run_id, "runs": runs.to_dict("records"), "rows": rows, "tensors": tensors}
    finally:
        store.close()


if __name__ == "__main__":
    torch.save(dump(sys.argv[1]), sys.argv[2])
