"""The committed golden values agree with each other: every case that runs on one H200 has H200
goldens, recorded from a real run (counts and iterations equal the CPU goldens, loss within the
runner's tolerance). A stale or hand-edited golden file fails here, before any training runs."""

import json
import os

import pytest

from tests.functional_tests.runner import LOSS_RTOL, all_cases, golden_path, load_case

SINGLE_GPU_H200 = [
    c
    for c in all_cases()
    if "h200" in (load_case(c).get("PLATFORMS") or ["cpu", "h200"]) and int(load_case(c)["NPROC"]) == 1
]


def golden(case: str, platform: str) -> dict:
    with open(golden_path(case, platform), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("case", SINGLE_GPU_H200, ids=os.path.basename)
def test_h200_goldens_exist_and_agree_with_cpu(case):
    h200 = golden(case, "h200")
    assert h200["dmi_record_counts"] and len(h200["dmi_checksums"]) == sum(h200["dmi_record_counts"].values())
    if not os.path.exists(golden_path(case, "cpu")):
        return  # GPU-only case (CUDA graphs)
    cpu = golden(case, "cpu")
    assert h200["dmi_record_counts"] == cpu["dmi_record_counts"]
    assert h200["dmi_iterations"] == cpu["dmi_iterations"]
    assert set(h200["dmi_checksums"]) == set(cpu["dmi_checksums"])
    for step, loss in cpu["lm loss"]["values"].items():
        assert abs(h200["lm loss"]["values"][step] - loss) <= LOSS_RTOL * abs(loss), step


def test_every_single_gpu_h200_case_is_covered():
    assert {os.path.basename(c) for c in SINGLE_GPU_H200} >= {
        "tiny_router_attn",
        "selection",
        "selective_recompute",
        "full_recompute",
        "ckpt_resume",
        "capacity_drop",
        "cuda_graph_local",
    }
