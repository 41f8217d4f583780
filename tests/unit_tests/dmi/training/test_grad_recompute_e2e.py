"""Gradients end to end: pretrain_gpt.py trains the tiny MoE in CPU mode with --dmi-hooks grad,
without recompute, with full recompute and with selective (core_attn) recompute. Each run stores
exactly one record per (iteration, microbatch, layer, output); without recompute they equal,
bitwise, what the in-run oracle's plain backward hooks saw (tests/functional_tests/
oracle_launch.py), and recompute stores the same bits (it re-runs the same forward)."""

import os

import pytest
import torch

from tests.functional_tests.launch import dump_store, load_oracle, run_pretrain, tiny_moe_args
from tests.functional_tests.oracle_compare import bitwise

LAYERS, MICROBATCHES, ITERS = 2, 2, 3
GRADIENTS = ("grad.attn_context", "grad.resid_in", "grad.router_logits")
RECOMPUTE = {
    "none": [],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
}
_runs: dict[str, tuple[dict, dict]] = {}


def run(recompute: str, tmp_path_factory) -> tuple[dict, dict]:
    if recompute not in _runs:
        tmp = str(tmp_path_factory.mktemp(f"grad_{recompute}"))
        store = os.path.join(tmp, "store")
        args = ["--train-iters", str(ITERS), "--dmi-hooks", "grad", "--dmi-store-dir", store]
        run_pretrain(tiny_moe_args() + args + RECOMPUTE[recompute], tmp)
        _runs[recompute] = dump_store(store, tmp), load_oracle(tmp)
    return _runs[recompute]


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_one_record_per_gradient(recompute, tmp_path_factory):
    dump, _ = run(recompute, tmp_path_factory)
    keys = sorted((r["iteration"], r["microbatch"], r["layer"], r["output"], r["invocation"]) for r in dump["rows"])
    assert keys == sorted(
        (it, mb, layer, o, 0)
        for it in range(1, ITERS + 1)
        for mb in range(MICROBATCHES)
        for layer in range(LAYERS)
        for o in GRADIENTS
    )


def test_gradients_equal_plain_backward_hooks(tmp_path_factory):
    dump, oracle = run("none", tmp_path_factory)
    compared = 0
    for (it, mb, layer), seen in oracle.items():
        for output in GRADIENTS:
            assert bitwise(dump["tensors"][("train", it, mb, layer, output, 0, 0)], seen[output]), (it, mb, layer)
            compared += 1
    assert compared == ITERS * MICROBATCHES * LAYERS * len(GRADIENTS)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_stores_the_bits_of_a_run_without_it(recompute, tmp_path_factory):
    plain, _ = run("none", tmp_path_factory)
    dump, _ = run(recompute, tmp_path_factory)
    assert dump["tensors"].keys() == plain["tensors"].keys()
    for key, tensor in dump["tensors"].items():
        assert isinstance(tensor, torch.Tensor) and bitwise(tensor, plain["tensors"][key]), key
