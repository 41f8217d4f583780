"""CPU development mode: the compatibility shim that lets megatron-core 0.17.1 train on a CPU.

Active only when ``--cpu-dev-mode`` is given to pretrain_gpt.py, when tests call ``enable()``, or
when a megatron-core loop with no GPU asks for it (examples/custom_loop.py); never otherwise. It
lives in megatron.core.dmi so that such loops need nothing of ``megatron.training``; the training
entry asks ``enable`` for the ``cpu-training`` group of patches its own code needs too. Its
megatron-core replacements are the ``cpu`` rows of ``upstream_patches.TARGETS`` (built by the
functions here); the torch ones are listed here. megatron-core assumes CUDA in a handful of places,
and each patch answers exactly one of them:

* ``device='cuda'`` literals, ``Tensor.cuda()`` and ``torch.cuda.current_device()`` as a device:
  a TorchFunctionMode maps every CUDA device argument to the CPU;
* ``torch.cuda.is_available`` (asserted during initialisation) reports True while
  ``device_count`` stays 0, so no CUDA device is ever selected;
* the CUDA RNG state helpers of megatron's tensor-parallel RNG tracker use the CPU generator;
* CUDA streams and events become no-ops;
* the GPU compute-capability query of Megatron's argument checks gets an answer, and gloo's
  all_to_all_single gets its split sizes as lists (the alltoall dispatcher passes tensors);
* torch's LayerNorm is accepted under sequence parallelism, its parameters marked for the TP
  gradient all-reduce as TE's norms are;
* the JIT warm-up (CUDA fusions) is skipped and torch.compile'd fusions run eagerly.

Gradient clipping (asserts CUDA tensors) and data-loader workers cannot be shimmed cheaply, so the
entry script adds ``--clip-grad 0 --num-workers 0`` unless the user chose values.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
from torch.overrides import TorchFunctionMode

from megatron.core.dmi import upstream_patches

_CPU = torch.device("cpu")


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and (_is_cuda(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs["device"] = _CPU
        if func in (torch.Tensor.to,) and len(args) > 1 and (_is_cuda(args[1]) or isinstance(args[1], int)):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.pin_memory:
            return args[0]
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def is_capturing(self):
        return False

    def record_event(self, event=None):
        return event or _NullEvent()


class _NullEvent(_NullStream):
    def record(self, *a, **k):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _with_mode(fn):
    """A mode is off while its handler runs, so backward (dispatched through it) runs without it;
    activation-recompute replays inside backward run forward code that needs it."""

    def run(*args, **kwargs):
        with _CudaToCpu():
            return fn(*args, **kwargs)

    return run


def backward_with_cpu_mode(original):
    """``CheckpointFunction.backward`` with the CPU device mode on (a ``cpu`` upstream patch)."""
    return staticmethod(_with_mode(original))


def recompute_with_cpu_mode(original):
    """``CheckpointWithoutOutput._recompute`` with the CPU device mode on (a ``cpu`` upstream patch)."""
    return _with_mode(original)


def cpu_rng_state(original):
    """The tensor-parallel RNG tracker's "CUDA" state getter, on the CPU generator."""
    return lambda *a, **k: torch.get_rng_state()


def set_cpu_rng_state(original):
    """The tensor-parallel RNG tracker's "CUDA" state setter, on the CPU generator."""
    return lambda new_state, *a, **k: torch.set_rng_state(new_state)


def _all_to_all_with_list_splits(original):
    """megatron-core's alltoall token dispatcher hands all_to_all_single its split sizes as tensors
    when it has no CUDA sync point to turn them into lists; gloo's binding takes only int lists."""

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    return all_to_all_single


def torch_norm_with_sequence_parallel(original_new):
    """Without TE or apex the local spec's norm is torch's, which megatron-core refuses under sequence
    parallelism only because its parameters lack the ``sequence_parallel`` mark that makes Megatron
    all-reduce their gradients over the TP group. Build it as usual and add the mark."""

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    return staticmethod(__new__)


def _torch_patches() -> list[tuple[object, str, object]]:
    cuda = torch.cuda
    return [
        (cuda, "is_available", lambda: True),
        (cuda, "device_count", lambda: 1),  # initialisation builds model-parallel groups only when > 0
        (cuda, "current_device", lambda: _CPU),
        (cuda, "set_device", lambda *a, **k: None),
        (cuda, "synchronize", lambda *a, **k: None),
        (cuda, "empty_cache", lambda: None),
        (cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (cuda, "manual_seed_all", lambda seed: None),  # torch.manual_seed calls it after seeding the CPU
        (cuda, "Stream", _NullStream),
        (cuda, "Event", _NullEvent),
        (cuda, "current_stream", lambda *a, **k: _NullStream()),
        (cuda, "default_stream", lambda *a, **k: _NullStream()),
        (cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (cuda, "set_stream", lambda *a, **k: None),
        (cuda, "memory_allocated", lambda *a, **k: 0),
        (cuda, "max_memory_allocated", lambda *a, **k: 0),
        (cuda, "memory_reserved", lambda *a, **k: 0),
        (cuda, "max_memory_reserved", lambda *a, **k: 0),
        (cuda, "reset_peak_memory_stats", lambda *a, **k: None),
        (cuda, "is_current_stream_capturing", lambda: False),
        (torch.accelerator, "current_stream", lambda *a, **k: _NullStream()),  # optimizers ask it
        (torch.distributed, "all_to_all_single", _all_to_all_with_list_splits(torch.distributed.all_to_all_single)),
        # megatron's jit_fuser is torch.compile: on a CPU it only costs compile time for tiny models.
        (torch._dynamo.config, "disable", True),
    ]


_mode: _CudaToCpu | None = None
_groups: tuple[str, ...] = ()
_RNG_LOGGER = logging.getLogger("megatron.core.tensor_parallel.random")
_rng_logger_level = logging.NOTSET


def enable(extra_groups: tuple[str, ...] = ()) -> None:
    """Install the shim in this process (idempotent).

    Args:
        extra_groups: more groups of ``upstream_patches`` to install with it and undo with it in
            ``disable`` (the training entry's ``cpu-training``).
    """
    global _mode, _groups, _rng_logger_level
    if _mode is not None:
        return
    _groups = ("cpu", *extra_groups)
    for group in _groups:
        upstream_patches.install(group)
    for owner, name, value in _torch_patches():  # torch's, undone with the group's
        upstream_patches.replace("cpu", owner, name, value)
    # The tracker's "GPU" states are CPU generator states here, so its CPU-state check always fires.
    _rng_logger_level = _RNG_LOGGER.level
    _RNG_LOGGER.setLevel(logging.ERROR)
    _mode = _CudaToCpu()
    _mode.__enter__()


def disable() -> None:
    """Undo ``enable`` (tests use the shim per module and leave the process as they found it)."""
    global _mode, _groups
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    for group in reversed(_groups):
        upstream_patches.restore(group)
    _groups = ()
    _RNG_LOGGER.setLevel(_rng_logger_level)


def enabled() -> bool:
    """Whether CPU mode is on in this process."""
    return _mode is not None


def compute_device() -> torch.device:
    """The device training computes on: the CPU in CPU mode, else the current CUDA device."""
    return _CPU if enabled() else torch.device("cuda", torch.cuda.current_device())
