"""Helpers for tests that run pretrain_gpt.py for real (CPU development mode) and read the store."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_moe_args() -> list[str]:
    """The tiny MoE model of examples/tiny_moe_args.sh (one definition for docs and tests)."""
    out = subprocess.run(
        ["bash", "-c", f"source {REPO}/examples/tiny_moe_args.sh; printf '%s\\n' \"${{TINY_MOE_ARGS[@]}}\""],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def run_pretrain(
    args: list[str],
    tmp: str,
    nproc: int = 1,
    oracle: bool = True,
    timeout: int = 600,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """pretrain_gpt.py (under the oracle launcher with ``oracle``) with ``args`` in CPU mode, in ``tmp``; ``env``:
    variables added to this process's environment."""
    script = os.path.join(HERE, "oracle_launch.py") if oracle else os.path.join(REPO, "pretrain_gpt.py")
    env = dict(os.environ, DMI_ORACLE_OUT=os.path.join(tmp, "oracle"), PYTHONUNBUFFERED="1", **(env or {}))
    if nproc == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            script,
        ]
    proc = subprocess.run(
        cmd + args + ["--cpu-dev-mode"], cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
    )
    with open(os.path.join(tmp, "train.log"), "w") as f:
        f.write(shlex.join(cmd + args) + "\n" + proc.stdout + proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"pretrain_gpt.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def dump_store(store_dir: str, tmp: str) -> dict:
    out = os.path.join(tmp, "dump.pt")
    subprocess.run(
        [sys.executable, os.path.join(HERE, "store_dump.py"), store_dir, out],
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=300,
    )
    return torch.load(out, weights_only=False)


def load_oracle(tmp: str, rank: int = 0) -> dict:
    return torch.load(os.path.join(tmp, "oracle", f"oracle-rank{rank}.pt"), weights_only=False)
