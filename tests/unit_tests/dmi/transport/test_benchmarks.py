"""The host-cost, site-cost and paired step-time benchmarks run on the CPU at a tiny scale and write the
results their GPU runs are read by (the figures themselves are not asserted: wall-clock time)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--micro-batch", "1"]


def _run(script: str, *args: str) -> None:
    proc = subprocess.run(
        # faulthandler: a crash of the native ring or its drain thread leaves every thread's Python stack
        [sys.executable, "-X", "faulthandler", os.path.join(REPO, "benchmarks", script), *TINY, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.slow
def test_host_cost_clocks_every_group_and_names_the_device(tmp_path):
    out = tmp_path / "host_cost.json"
    _run("host_cost.py", "--steps", "2", "--warmup", "1", "--out", str(out))
    got = json.loads(out.read_text())
    assert got["device"]
    for key in ("router.host_us_per_firing", "attn.host_us_per_firing", "not_captured.host_us_per_site"):
        assert got[key]["firings"] > 0, key
    for group in ("resid", "mlp", "mlp.experts", "loss", "logits", "grad"):
        assert got[f"{group}.host_us_per_firing"]["firings"] > 0, group


@pytest.mark.slow
def test_paired_step_time_alternates_capture_per_step_and_reports_intervals(tmp_path):
    out = tmp_path / "paired.json"
    _run("step_time_paired.py", "--pairs", "3", "--warmup", "1", "--resamples", "50", "--out", str(out))
    got = json.loads(out.read_text())
    assert got["device"] and got["aa_floor_pct"] >= 0 and got["aa"]["pairs"] == 6
    layers, moe_outputs = 2, 4
    for arm, per_layer in (("b_router", moe_outputs), ("c_router_attn", moe_outputs + 1)):
        lo, hi = got[arm]["ci95_pct"]
        assert got[arm]["pairs"] == 3 and lo <= hi
        # the per-step switch: captured steps publish every selected output, uncaptured ones nothing
        assert got[arm]["records_per_captured_step"] == layers * per_layer
        assert got[arm]["records_per_uncaptured_step"] == 0


@pytest.mark.slow
def test_site_cost_clocks_each_site_per_arm_and_counts_its_calls(tmp_path):
    out = tmp_path / "site_cost.json"
    _run("site_cost.py", "--blocks", "1", "--calls", "30", "--out", str(out))
    got = json.loads(out.read_text())
    assert got["device"]
    for site in ("router", "attn"):
        for arm in ("off", "uncaptured", "captured"):
            assert got[f"{site}.{arm}"]["python_calls"] > 0, (site, arm)
        assert "dmi_us_per_call" in got[f"{site}.captured"]
    # an uncaptured router firing runs DMI's wrapper and nothing else of Python
    assert got["router.uncaptured"]["python_calls"] == got["router.off"]["python_calls"] + 1
