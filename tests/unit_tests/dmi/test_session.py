"""The core API: a plain megatron-core loop drives DMI through DMISession (no megatron.training)."""

import json
import os
import subprocess
import sys

import pytest

from megatron.core.dmi.catalog import UnsupportedUnderGraphsError, parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.session import DMISession

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

READ = """
import json, sys
from megatron.core.dmi.reader import open_store
with open_store(sys.argv[1]) as s:
    run = s.resolve_run(None)
    rows = s.sql("SELECT output, count() AS n FROM " + s.t("tensors") + " FINAL GROUP BY output").to_pylist()
    print(json.dumps({"run": run, "counts": {r["output"]: r["n"] for r in rows}}))
"""


def test_custom_loop_example_trains_on_the_cpu_without_megatron_training_and_reads_back(tmp_path):
    # Run from a directory outside the checkout, as a user would; fail if megatron.training loads.
    code = (
        "import runpy, sys; sys.argv = ['custom_loop.py']; "
        f"runpy.run_path({os.path.join(REPO, 'examples', 'custom_loop.py')!r}, run_name='__main__'); "
        "assert 'megatron.training' not in sys.modules, 'the core API imported megatron.training'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "written 80 (" in proc.stdout and "dropped 0" in proc.stdout  # report: every record verified in
    store = tmp_path / "dmi_store" / "custom_loop"
    state = json.loads((store / "checkpoint_state_iter_2.json").read_text())
    out = subprocess.run([sys.executable, "-c", READ, str(store)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # 4 iterations x 2 microbatches x 2 layers per output
    assert got == {
        "run": state["run_id"],
        "counts": {
            o: 16
            for o in ("attn.context", "router.expert_counts", "router.logits", "router.topk_ids", "router.topk_probs")
        },
    }


def test_resuming_from_a_saved_state_continues_the_run_under_a_new_attempt(tmp_path):
    config = DMIConfig(hooks=parse_hooks("router"), persist="none", store_dir=str(tmp_path), transport="torch")
    first = DMISession(config, command_line=["loop.py"])
    state = first.state(6)
    assert first.close().lines and first.close() is first.close()  # idempotent
    second = DMISession(config, resumed_run_id=state["run_id"], resumed_from_iteration=state["iteration"])
    try:
        assert (second.run_id, second.attempt) == (state["run_id"], state["attempt"] + 1)
    finally:
        second.close()
    fresh = DMISession(config)
    try:
        assert fresh.run_id != state["run_id"] and fresh.attempt == 1
    finally:
        fresh.close()


def test_the_session_hands_the_ring_and_drain_settings_of_its_config_to_the_transport_and_drain(tmp_path):
    config = DMIConfig(
        hooks=parse_hooks("router"),
        persist="none",
        store_dir=str(tmp_path),
        transport="torch",
        ring_mb=2.0,
        on_full="drop",
        block_timeout=3.5,
        flush_records=7,
    )
    session = DMISession(config)
    try:
        t = session.transport
        assert (t.ring_bytes, t.on_full, t.block_timeout) == (2 << 20, "drop", 3.5)
        assert session.drain.batch_records == 7
    finally:
        session.close()


def test_gradients_under_cuda_graphs_are_refused_before_anything_starts(tmp_path):
    config = DMIConfig(hooks=parse_hooks("router,grad.attn_context"), persist="none", store_dir=str(tmp_path))
    with pytest.raises(UnsupportedUnderGraphsError, match=r"grad\.attn_context .*--cuda-graph-impl") as e:
        DMISession(config, cuda_graphs=True)
    assert isinstance(e.value, DMIError)
    assert not (tmp_path / "attempts").exists()  # refused before a run id or attempt was taken
