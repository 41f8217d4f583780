"""A run watched while it trains (issue 20): ``megatron-dmi watch --once --json`` and ``show`` run
beside pretrain_gpt.py (CPU development mode, embedded store); the numbers grow during the run, no
reader meets a lock, and every frame agrees with the final store."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.functional_tests.launch import REPO, tiny_moe_args
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W

LAYERS, MICROBATCHES, ITERS, OUTPUTS = 2, 2, 120, 4


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_dmi", *argv], capture_output=True, text=True, cwd=REPO, timeout=600
    )


def _frame(store: str, *extra: str) -> dict:
    p = _cli("watch", store, "--once", "--json", *extra)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return json.loads(p.stdout)


PAUSES = (40, 80)  # the run waits at the start of these iterations while the test reads the store


@pytest.mark.slow
def test_watch_and_show_while_training(tmp_path):
    store = str(tmp_path / "store")
    signals = tmp_path / "signals"
    signals.mkdir()
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
    env = dict(os.environ, DMI_PAUSE_AT=",".join(map(str, PAUSES)), DMI_PAUSE_DIR=str(signals))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "paused_launch.py"), *args],
        cwd=str(tmp_path),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    live, shown = [], None
    try:
        for iteration in PAUSES:
            deadline = time.monotonic() + 1200
            while not (signals / f"paused-{iteration}").exists():
                assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "train.log").read()[-3000:]
                time.sleep(0.2)
            # the run is paused mid-training: a reader must see what it flushed, beside its ingester
            live.append((iteration, _frame(store, "--no-entropy")))
            if shown is None:
                s = _cli("show", store)
                assert s.returncode == 0 and s.stderr == "", s.stderr
                shown = s.stdout
            (signals / f"resume-{iteration}").touch()
        rc = proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert rc == 0, open(tmp_path / "train.log").read()[-3000:]
    records = [f["records"] for _, f in live]
    # everything captured before each pause, and no more: the numbers grow with the run
    assert records == [(it - 1) * LAYERS * MICROBATCHES * OUTPUTS for it in PAUSES], records
    assert shown is not None and "records per output:" in shown and "expert load" in shown
    live = [f for _, f in live]

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
