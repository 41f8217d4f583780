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
        "resid_mlp_loss_logits",
        "grad_experts",
    }


TE_CASES = [c for c in all_cases() if "h200_te" in (load_case(c).get("PLATFORMS") or [])]
TE_RECORDED = [c for c in TE_CASES if os.path.exists(golden_path(c, "h200_te"))]
# Transformer Engine cases added since the last GPU run: the next run_h200_te.sh records them
# (check_h200_te.py --record-golden), and then they leave this set.
TE_AWAITING_GPU: set[str] = set()


@pytest.mark.parametrize("case", TE_RECORDED, ids=os.path.basename)
def test_te_goldens_hold_the_analytic_counts(case):
    """A Transformer Engine case's goldens (recorded from an H200 run by check_h200_te.py) hold
    exactly the records its arguments imply, a checksum for each, and every training step's loss."""
    from tests.functional_tests.layouts import expected_record_counts
    from tests.functional_tests.runner import model_args

    te = golden(case, "h200_te")
    args = model_args(load_case(case), "h200_te", {"DMI_STORE": "-"})
    expected = {f"train/{o}": n for o, n in expected_record_counts(args, 1).items()}
    assert te["dmi_record_counts"] == expected
    assert len(te["dmi_checksums"]) == sum(expected.values())
    iters = int(args[args.index("--train-iters") + 1])
    assert sorted(te["lm loss"]["values"], key=int) == [str(i) for i in range(1, iters + 1)]


def test_every_te_case_is_recorded():
    """Every Transformer Engine case ran on a lent Hopper GPU and has goldens (2026-12-05; the CUDA-graph
    cases since they train in bf16: docs/capabilities.md), but those awaiting their first GPU run, which have
    none yet."""
    awaiting = [c for c in TE_CASES if os.path.basename(c) in TE_AWAITING_GPU]
    assert len(awaiting) == len(TE_AWAITING_GPU) and not set(awaiting) & set(TE_RECORDED)
    assert TE_RECORDED == [c for c in TE_CASES if c not in awaiting] and {os.path.basename(c) for c in TE_CASES} >= {
        "te_router_attn",
        "te_qk",
        "te_selective_recompute",
        "te_recompute_moe_act",
        "te_full_recompute",
        "te_dense",
        "mla_te",
        "te_fp8_dense",
        "te_fp8_moe",
        "te_cuda_graph",
        "te_cuda_graph_dense_layer",
    }


@pytest.mark.parametrize("case", SINGLE_GPU_H200 + TE_RECORDED, ids=os.path.basename)
def test_gpu_goldens_are_bitwise(case):
    """A GPU golden holds checksums only: no statistics that would let a run's bits drift."""
    platform = "h200_te" if case in TE_RECORDED else "h200"
    assert "dmi_stats" not in golden(case, platform)


CPU_CASES = [c for c in all_cases() if "cpu" in (load_case(c).get("PLATFORMS") or ["cpu"])]


@pytest.mark.parametrize("case", CPU_CASES, ids=os.path.basename)
def test_cpu_goldens_carry_statistics_for_every_checksum(case):
    g = golden(case, "cpu")
    assert set(g["dmi_stats"]) == set(g["dmi_checksums"]) and all(len(v) == 3 for v in g["dmi_stats"].values())


def test_a_golden_tolerates_last_bit_drift_but_not_misplaced_values():
    """Where the bits differ (another processor), the statistics decide: rounding-level drift passes,
    the same values in other places do not."""
    import torch

    from tests.functional_tests.runner import compare
    from tests.functional_tests.store_dump import tensor_crc, tensor_stats

    t = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))

    def summary(x):
        return {
            "lm loss": {"values": {"1": 1.0}},
            "dmi_iterations": {"train": [1]},
            "dmi_record_counts": {"train/x": 1},
            "dmi_checksums": {"k": tensor_crc(x)},
            "dmi_stats": {"k": tensor_stats(x)},
        }

    golden_of_t = summary(t)
    assert compare(summary(t), golden_of_t) == []
    drifted = t * (1 + 1e-6)
    assert tensor_crc(drifted) != tensor_crc(t) and compare(summary(drifted), golden_of_t) == []
    swapped = t[torch.randperm(64, generator=torch.Generator().manual_seed(1))]  # the same rows, other places
    assert tensor_stats(swapped)[:2] == pytest.approx(tensor_stats(t)[:2])
    assert compare(summary(swapped), golden_of_t) != []
    without_stats = {k: v for k, v in golden_of_t.items() if k != "dmi_stats"}  # H200 goldens: bitwise
    assert compare(summary(drifted), without_stats) != []
