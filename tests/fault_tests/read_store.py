"""Read a DMI store in its own process (chDB: one store per process) and print, as JSON, what the
fault tests assert: per run and attempt the stored rows, the visible (deduplicated, superseded)
records per iteration, the end-of-run reports, drops, corrupt segments and the runs table text.

    python tests/fault_tests/read_store.py <store dir or server URL> [extra table ...]
    python tests/fault_tests/read_store.py --count <store dir or server URL> [table]

``--count`` is a plain SQL count of a tensor table per run and attempt, with nothing ingested
first: what the store holds, to compare with a run's end-of-run report.
"""

import collections
import json
import os
import sys

from megatron.core.dmi.reader import open_store


def read(store_dir: str, extra_tables: list[str]) -> dict:
    with open_store(store_dir) as s:
        ing = s.ingest_result
        out = {
            "ingest": {
                "loaded": ing.segments_loaded,
                "corrupt": ing.segments_corrupt,
                "records": ing.records,
                "errors": ing.errors,
            },
            "runs": {},
            "extra": {},
        }
        for t in extra_tables:
            out["extra"][t] = (
                s.sql(
                    f"SELECT count() AS n FROM (SELECT DISTINCT run_id, iteration, microbatch, layer, "
                    f"output, rank, attempt FROM {s.t(t)})"
                )
                .column("n")[0]
                .as_py()
            )
        runs = s.runs()
        for run_id in runs["run_id"]:
            d = s.describe(run_id)
            rows = s.sql(
                f"SELECT attempt, phase, iteration, microbatch, layer, output, rank, dp FROM {s.t('tensors')} FINAL "
                "WHERE run_id = {r:String}",
                {"r": run_id},
            ).to_pylist()
            per_attempt = collections.Counter(r["attempt"] for r in rows)
            vis = s.visible_attempts(run_id)
            visible = [r for r in rows if vis.get((r["phase"], r["iteration"])) == r["attempt"]]
            keys = collections.Counter(
                (r["phase"], r["iteration"], r["microbatch"], r["layer"], r["output"], r["rank"], r["dp"])
                for r in visible
            )
            per_iter = collections.Counter(r["iteration"] for r in visible)
            # every visible tensor rebuilds (per data-parallel rank: a signal can stop the ranks in different steps)
            rebuilt = 0
            for phase, it, mb, layer, output, _rank, dp in keys:
                s.tensor(run_id, output, it, mb, layer, phase=phase, dp=dp)
                rebuilt += 1
            reps = s.reports(run_id)
            cfg = s.sql(
                f"SELECT config_json, versions_json FROM {s.t('runs')} WHERE run_id = {{r:String}}", {"r": run_id}
            ).to_pylist()
            out["runs"][run_id] = {
                "records": d.records,
                "superseded": d.superseded_records,
                "dropped": d.dropped_records,
                "rows_per_attempt": {str(k): v for k, v in sorted(per_attempt.items())},
                "visible_per_iteration": {str(k): v for k, v in sorted(per_iter.items())},
                "duplicate_visible_keys": sum(1 for v in keys.values() if v > 1),
                "visible_attempt": {f"{p}:{i}": a for (p, i), a in sorted(vis.items())},
                "rebuilt": rebuilt,
                "reports": reps.to_dict("records") if not reps.empty else [],
                "runs_table": json.dumps(cfg),
            }
        return out


def count(store: str, table: str = "tensors") -> dict:
    from megatron.core.dmi.store.backend import ChdbBackend, ServerBackend

    b = ServerBackend(store) if "://" in store else ChdbBackend(os.path.join(store, "chdb"))
    try:
        rows = b.query_arrow(f"SELECT run_id, attempt, count() AS n FROM {b.t(table)} FINAL GROUP BY run_id, attempt")
    finally:
        b.close()
    return {f"{r['run_id']}:{r['attempt']}": r["n"] for r in rows.to_pylist()}


if __name__ == "__main__":
    if sys.argv[1] == "--count":
        print("READ_STORE " + json.dumps(count(*sys.argv[2:])))
    else:
        print("READ_STORE " + json.dumps(read(sys.argv[1], sys.argv[2:]), default=str))
