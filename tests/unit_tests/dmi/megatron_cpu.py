"""Real megatron-core modules on the CPU for unit tests: the CPU shim plus a one-process gloo
world with model-parallel groups, torn down afterwards so other tests see a clean process."""

from __future__ import annotations

import contextlib
import socket

import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron.core import parallel_state as ps
from megatron.core.dmi import cpu_mode


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_on_cpu(seed: int = 1234):
    cpu_mode.enable()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        yield
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        cpu_mode.disable()
