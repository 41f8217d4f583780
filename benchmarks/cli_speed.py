"""Wall time of the reading CLI, each command a fresh process as a user runs it (issue 20).

Arms (median and min of ``--repeats`` runs each):

- ``help``:            ``megatron-dmi show --help``
- ``show``:            ``megatron-dmi show STORE`` (the fast entry point: no torch, no megatron-core)
- ``show_module``:     ``python -m megatron.core.dmi show STORE`` (Python imports megatron-core's
                       package first: the price of that spelling)
- ``show_while_held``: ``megatron-dmi show`` on a copy of STORE that another process holds open and
                       inserts into every 0.1 s, as a training run's ingester does (snapshot reads)
- ``chdb_sql``:        the baseline: one process opening a copy of the store with chDB and running
                       the run-listing query, nothing else

Also records the snapshot's own cost (link time, parts and files linked) and the stderr lines of
``show`` (upstream warnings would land there). Usage::

    bash examples/quickstart.sh        # makes dmi_store/quickstart
    .venv/bin/python benchmarks/cli_speed.py dmi_store/quickstart --json benchmarks/results/cli_speed_cpu2.json

``--commands`` measures every reading command instead (issue 32), each a whole process, on each store given:
``show``, ``runs``, ``describe``, ``expert-load``, ``drops``, ``tensor`` (the first captured output, iteration and
layer), ``watch --once``, the routing analyses whose outputs the store holds and ``routing-diff`` (the run
against itself)::

    .venv/bin/python benchmarks/cli_speed.py --commands dmi_store/quickstart dmi_store/it300 \
        --repeats 5 --json benchmarks/results/cli_commands_cpu2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from results_json import write_json  # benchmarks/ is the script directory

HOLDER = r"""
import sys, time
from megatron.core.dmi.store.backend import ChdbBackend
b = ChdbBackend(sys.argv[1])
b.command("CREATE TABLE IF NOT EXISTS dmi.bench_ticks (x UInt64) ENGINE = MergeTree ORDER BY x")
print("holding", flush=True)
i = 0
while True:
    b.command(f"INSERT INTO dmi.bench_ticks SELECT number + {i * 100} FROM numbers(100)")
    i += 1
    time.sleep(0.1)
"""

CHDB_SQL = r"""
import sys
from chdb import session
s = session.Session(sys.argv[1])
s.query("SELECT run_id, count() FROM dmi.tensors FINAL GROUP BY run_id", "CSV")
"""


def _cli() -> list[str]:
    exe = shutil.which("megatron-dmi", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "megatron_dmi"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd: list[str], repeats: int) -> dict:
    """Wall seconds per run, and CPU seconds (user + system: what a shared machine's load does not
    inflate as much)."""
    runs, cpu, stderr_lines = [], [], 0
    for _ in range(repeats):
        c0, t0 = _children_cpu(), time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        runs.append(time.perf_counter() - t0)
        cpu.append(_children_cpu() - c0)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
        stderr_lines = len(p.stderr.splitlines())
    return {
        "median_s": statistics.median(runs),
        "min_s": min(runs),
        "runs_s": runs,
        "cpu_median_s": statistics.median(cpu),
        "stderr_lines": stderr_lines,
    }


def snapshot_cost(store: str) -> dict:
    """What one snapshot links, from the reader itself (in this process: no chDB open elsewhere)."""
    code = (
        "import json, sys, dataclasses; import megatron_dmi; megatron_dmi.register_bare_core();"
        "from megatron.core.dmi.reader import open_store;"
        "s = open_store(sys.argv[1]); print(json.dumps(dataclasses.asdict(s.snapshot_stats))); s.close()"
    )
    p = subprocess.run([sys.executable, "-c", code, store], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


PROBE = r"""
import json, sys, megatron_dmi
with megatron_dmi.open_store(sys.argv[1]) as s:
    d = s.describe(None)
    t = d.outputs[d.outputs["phase"] == "train"]
    first = t[t["output"] != "router.weight"].iloc[0]
    print(json.dumps({"outputs": sorted(t["output"]), "iterations": len(d.iterations.get("train", [])),
                      "records": d.records, "tensor": [first["output"], int(first["first_iteration"]),
                      int(first["layers"][0])]}))
"""

# The analyses and the outputs each needs (reader/analyses.py).
ANALYSES = {
    "routing-concentration": {"router.expert_counts"},
    "routing-predictability": {"router.weight", "resid.in", "router.expert_counts"},
    "loss-vs-routing": {"loss.token", "router.topk_ids"},
    "grad-norms": {"grad.resid_in"},
}


def reading_commands(store: str) -> tuple[dict[str, list[str]], dict]:
    """Each reading command's arguments on ``store`` (the analyses its outputs allow), and what the store holds."""
    p = subprocess.run([sys.executable, "-c", PROBE, store], capture_output=True, text=True, check=True)
    facts = json.loads(p.stdout.strip().splitlines()[-1])
    output, iteration, layer = facts["tensor"]
    commands = {
        "show": ["show", store],
        "runs": ["runs", store],
        "describe": ["describe", store],
        "expert-load": ["expert-load", store],
        "drops": ["drops", store],
        "tensor": ["tensor", store, "--output", output, "--iteration", str(iteration), "--layer", str(layer)],
        "watch --once": ["watch", store, "--once"],
    }
    for name, needs in ANALYSES.items():
        if needs <= set(facts["outputs"]):
            commands[name] = [name, store]
    if "router.topk_ids" in facts["outputs"]:
        commands["routing-diff"] = ["routing-diff", store, store]  # the run against itself: two stores opened
    return commands, facts


def time_commands(stores: list[str], repeats: int) -> dict:
    """Every reading command on every store, ``repeats`` whole processes each."""
    cli, out = _cli(), {}
    for store in stores:
        commands, facts = reading_commands(store)
        arms = {name: timed(cli + argv, repeats) for name, argv in commands.items()}
        out[store] = {"facts": facts, "arms": arms}
        print(f"{store}: {facts['records']} records, {facts['iterations']} iterations")
        for name, a in arms.items():
            print(
                f"  {name:>22}: median {a['median_s']:.2f} s  min {a['min_s']:.2f} s  cpu {a['cpu_median_s']:.2f} s"
                f"  stderr lines {a['stderr_lines']}"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", nargs="+", help="a store directory (e.g. dmi_store/quickstart); several with --commands")
    ap.add_argument("--commands", action="store_true", help="time every reading command on each store")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    for store in args.store:
        if not os.path.isdir(os.path.join(store, "chdb")):
            raise SystemExit(f"no embedded store at {store} (run `bash examples/quickstart.sh` first)")
    machine = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "load_average_before": os.getloadavg(),
        "python": platform.python_version(),
    }
    if args.commands:
        stores = time_commands(args.store, args.repeats)
        if args.json:
            write_json(
                args.json,
                {
                    "benchmark": "cli_commands",
                    **machine,
                    "load_average_after": os.getloadavg(),
                    "cli": _cli(),
                    "stores": stores,
                },
            )
        return
    if len(args.store) > 1:
        raise SystemExit("one store, or --commands for several")
    args.store = args.store[0]
    cli = _cli()
    arms = {
        "help": timed(cli + ["show", "--help"], args.repeats),
        "show": timed(cli + ["show", args.store], args.repeats),
        "show_module": timed([sys.executable, "-m", "megatron.core.dmi", "show", args.store], args.repeats),
    }
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "store")
        shutil.copytree(args.store, copy, symlinks=True, ignore=shutil.ignore_patterns(".readers"))
        arms["chdb_sql"] = timed([sys.executable, "-c", CHDB_SQL, os.path.join(copy, "chdb")], args.repeats)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, os.path.join(copy, "chdb")], stdout=subprocess.PIPE, text=True
        )
        try:
            if holder.stdout.readline().strip() != "holding":
                raise SystemExit("the holder process did not open the store copy")
            arms["show_while_held"] = timed(cli + ["show", copy], args.repeats)
            snapshot = snapshot_cost(copy)
        finally:
            holder.kill()
            holder.wait()
    out = {
        "benchmark": "cli_speed",
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "store": os.path.abspath(args.store),
        "cli": cli,
        "arms": arms,
        "snapshot_while_held": snapshot,
    }
    for name, a in arms.items():
        print(
            f"{name:>16}: median {a['median_s']:.2f} s  min {a['min_s']:.2f} s  cpu {a['cpu_median_s']:.2f} s  "
            f"stderr lines {a['stderr_lines']}"
        )
    print(f"snapshot while held: {snapshot}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
