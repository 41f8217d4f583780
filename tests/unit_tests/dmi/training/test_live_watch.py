"""A run watched while it trains (issue 20): ``megatron-dmi watch --once --json`` and ``show`` run
beside pretrain_gpt.py (CPU development mode, embedded store); the numbers grow during the run, no
reader meets a lock, and every frame agrees with the final store."""

import json
import os
import subprocess
import sys
import time

import pytest

from megatron.core.dmi.sinks.isolated import run_isolated
from tests.functional_tests.launch import REPO, tiny_moe_args
from tests.unit_tests.dmi.sinks import workers as W

LAYERS, MICROBATCHES, ITERS, OUTPUTS = 2, 2, 120, 4
WATCH_SECONDS = 3.0


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_dmi", *argv], capture_output=True, text=True, cwd=REPO, timeout=600
    )


def _frame(store: str, *extra: str) -> dict:
    p = _cli("watch", store, "--once", "--json", *extra)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return json.loads(p.stdout)


@pytest.mark.slow
def test_watch_and_show_while_training(tmp_path):
    store = str(tmp_path / "store")
    args = tiny_moe_args() + [
        "--train-iters",
        str(ITERS),
        "--dmi-hooks",
        "router",
        "--dmi-persist",
        "clickhouse",
        "--dmi-store-dir",
        store,
        "--cpu-dev-mode",
    ]
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args],
        cwd=str(tmp_path),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    live, shown = [], None
    try:
        deadline = time.monotonic() + 1200
        while proc.poll() is None and time.monotonic() < deadline:
            if not os.path.isdir(os.path.join(store, "chdb")):
                time.sleep(0.5)
                continue
            time.sleep(WATCH_SECONDS)  # a watcher's pace: the run shares this machine's cores
            f = _frame(store, "--no-entropy")
            if proc.poll() is None and f["records"]:  # taken while the run was still training
                live.append(f)
                if shown is None:
                    s = _cli("show", store)
                    assert s.returncode == 0 and s.stderr == "", s.stderr
                    shown = s.stdout if proc.poll() is None else None
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert rc == 0, open(tmp_path / "train.log").read()[-3000:]
    records = [f["records"] for f in live]
    assert len(records) >= 2 and records == sorted(records) and records[-1] > records[0], records
    assert shown is not None and "records per output:" in shown and "expert load" in shown

    final = _frame(store)
    assert final["records"] == LAYERS * MICROBATCHES * ITERS * OUTPUTS
    assert final["last_iteration"] == ITERS and final["store_lag_records"] == 0
    assert all(0 < ls["entropy"] <= 1 for ls in final["layers"])
    load = run_isolated(W.store_call, store, "expert_load")
    for f in live + [final]:
        at = load[load["iteration"] == f["load_iteration"]]
        for ls in f["layers"]:
            mine = at[at["layer"] == ls["layer"]].sort_values("expert")
            assert ls["expert_tokens"] == [int(x) for x in mine["tokens_post"]]
            assert ls["tokens_routed"] == int(mine["tokens_pre"].sum())
    assert not os.path.exists(os.path.join(store, ".readers"))
