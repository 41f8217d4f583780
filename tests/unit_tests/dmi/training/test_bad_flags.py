"""Bad flags stop pretrain_gpt.py with one line naming the flag, before any model exists, as
argparse (and so Megatron's own argument errors) stops: ``<prog>: error: argument FLAG: why``,
exit 2, whether DMI's check, the model's or the data's refuses it."""

import os
import subprocess
import sys

import pytest

from tests.functional_tests.launch import REPO, tiny_moe_args

CASES = {
    "unknown hook": (["--dmi-hooks", "router,bogus"], "--dmi-hooks", "bogus"),
    "malformed layers": (["--dmi-hooks", "router", "--dmi-layers", "4-1"], "--dmi-layers", "4-1"),
    "non-positive interval": (["--dmi-hooks", "router", "--dmi-interval", "0"], "--dmi-interval", "'0'"),
    "ring smaller than a record": (["--dmi-hooks", "attn", "--dmi-ring-mb", "0.001"], "--dmi-ring-mb", "cannot hold"),
    "unreachable server": (
        ["--dmi-hooks", "router", "--dmi-clickhouse-url", "http://127.0.0.1:1"],
        "--dmi-clickhouse-url",
        "unreachable",
    ),
    "context parallelism": (["--dmi-hooks", "router", "--context-parallel-size", "2"], "--dmi-hooks", "context"),
    "layers beyond the model": (
        ["--dmi-hooks", "router", "--dmi-layers", "1,5"],
        "--dmi-layers",
        "layer(s) 5 not in this model: --num-layers 2 has layers 0-1",
    ),
    "ring smaller than a residual record": (
        ["--dmi-hooks", "resid", "--dmi-ring-mb", "0.01"],
        "--dmi-ring-mb",
        "one record of 16384 bytes",
    ),
    "ring smaller than an fp32 residual record of a bf16 model": (  # 32 x 2 x 64 fp32, not bf16
        ["--dmi-hooks", "resid", "--dmi-ring-mb", "0.01", "--bf16", "--fp32-residual-connection"],
        "--dmi-ring-mb",
        "one record of 16384 bytes",
    ),
    "ring smaller than an expert-rows record": (
        ["--dmi-hooks", "mlp.experts", "--dmi-ring-mb", "0.02"],
        "--dmi-ring-mb",
        "one record of 35328 bytes",
    ),
    "expert rows with the flex dispatcher": (
        ["--dmi-hooks", "mlp.experts", "--moe-token-dispatcher-type", "flex"],
        "--moe-token-dispatcher-type",
        "mlp.experts needs the allgather or alltoall token dispatcher",
    ),
    "expert rows with a capacity factor": (
        ["--dmi-hooks", "mlp.experts", "--moe-expert-capacity-factor", "1.0"],
        "--moe-expert-capacity-factor",
        "does not support token dropping",
    ),
    "full-iteration CUDA graph": (
        ["--dmi-hooks", "router", "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
        + ["--no-check-for-nan-in-loss-and-grad"],
        "--cuda-graph-scope",
        "full_iteration graphs replay every microbatch",
    ),
    "expert rows under CUDA graphs": (
        ["--dmi-hooks", "mlp.experts", "--cuda-graph-impl", "local", "--no-check-for-nan-in-loss-and-grad"],
        "--dmi-hooks",
        "mlp.experts cannot be captured under CUDA graphs",
    ),
    "gradients under CUDA graphs": (
        ["--dmi-hooks", "router,grad", "--cuda-graph-impl", "local", "--no-check-for-nan-in-loss-and-grad"],
        "--dmi-hooks",
        "grad.attn_context, grad.resid_in, grad.router_logits cannot be captured under CUDA graphs (--cuda-graph-impl)",
    ),
    "logits with multi-token prediction": (
        ["--dmi-hooks", "loss,logits", "--mtp-num-layers", "1"],
        "--dmi-hooks",
        "multi-token prediction",
    ),
    "a model this entry cannot build": (["--use-legacy-models"], "--use-legacy-models", "megatron.legacy"),
    "data this entry cannot read": (["--sft"], "--sft", "packed sequences need --micro-batch-size 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_flag_fails_before_the_model_is_built(case, tmp_path):
    extra, flag, detail = CASES[case]
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "pretrain_gpt.py"),
            *tiny_moe_args(),
            "--cpu-dev-mode",
            "--dmi-store-dir",
            str(tmp_path / "store"),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    error = [line for line in p.stderr.splitlines() if line.startswith(f"pretrain_gpt.py: error: argument {flag}: ")]
    assert len(error) == 1 and detail in error[0], out[-2000:]
    assert "Traceback" not in out
    assert "building GPT model" not in out


def test_a_value_argparse_rejects_prints_one_short_usage_line_before_the_error(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "pretrain_gpt.py"),
            *tiny_moe_args(),
            "--cpu-dev-mode",
            "--dmi-hooks",
            "router",
            "--dmi-interval",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert p.returncode == 2
    lines = p.stderr.splitlines()
    error = next(i for i, line in enumerate(lines) if "error: argument --dmi-interval" in line)
    # upstream's usage line alone lists every Megatron flag over ~640 lines
    assert lines[error - 1].startswith("usage: pretrain_gpt.py ") and len(lines[error - 1]) < 160, lines[error - 1]
    assert "--help" in lines[error - 1]


def test_no_gpu_without_cpu_mode_says_what_to_do(tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *tiny_moe_args()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert p.returncode != 0 and "--cpu-dev-mode" in p.stderr
