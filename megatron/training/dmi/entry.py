"""What a training entry needs from DMI: process preparation, the argument provider, the
forward-step wrapper and the ``pretrain`` wrapper that activate DMI inside
``megatron.training.pretrain``, and the replacements of the ``entry`` and ``cpu-training`` groups
of ``megatron.core.dmi.upstream_patches``."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import socket
import sys
from collections.abc import Callable

import torch

from megatron.core.dmi import cpu_mode, upstream_patches
from megatron.core.dmi.cpu_mode import compute_device  # noqa: F401  (the entry's batch code asks it here)
from megatron.training.dmi import CPU_DEV_FLAG

# Upstream's usage line lists every one of its ~1000 flags (about 640 lines) before each argument
# error; ours names the kinds of flags and where the full list is.
SHORT_USAGE = "%(prog)s [Megatron arguments] [--dmi-* arguments] [--cpu-dev-mode]  (all flags: %(prog)s --help)"
# Flags the CPU mode needs because megatron-core cannot honour them on a CPU (see cpu_mode.py).
CPU_REQUIRED_FLAGS = {"--clip-grad": "0", "--num-workers": "0", "--distributed-backend": "gloo"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prebuilt_dataset_helpers(compile_helpers: Callable) -> Callable:
    """Upstream's ``compile_helpers`` runs ``make``, but the megatron-core wheel ships ``helpers_cpp``
    prebuilt and no Makefile: when the module imports there is nothing to build (an ``entry`` patch)."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return compile_helpers  # a source checkout with a Makefile: keep upstream's build step
    return lambda: None


@contextlib.contextmanager
def flag_refusals_as_usage_errors():
    """Report a flag refusal (``arguments.FlagRefusal``) raised inside as argparse reports a bad
    argument, which is how Megatron's own argument errors end too: the one-line usage, then
    ``<prog>: error: argument --flag: why``, exit 2. Every refusal of a flag at start-up (DMI's,
    the model's, the data's) goes through here, so they all look and exit alike."""
    from megatron.training.dmi.arguments import FlagRefusal

    try:
        yield
    except FlagRefusal as refusal:
        prog = os.path.basename(sys.argv[0])
        sys.stderr.write(f"usage: {SHORT_USAGE % {'prog': prog}}\n{prog}: {refusal.code}\n")
        sys.exit(2)


def validate_args_with_dmi_layout(validate_args: Callable) -> Callable:
    """Megatron's argument validation, after DMI's refusal of layouts it cannot capture (an ``entry``
    patch), so bad input still fails before any process group or model exists."""
    from megatron.training.dmi.arguments import check_dmi_layout

    def validate(args, *a, **k):
        with flag_refusals_as_usage_errors():
            check_dmi_layout(args)
        return validate_args(args, *a, **k)

    return validate


def dmi_checks_before_argument_dump(print_args: Callable) -> Callable:
    """Megatron's argument dump (the last step of its validation), after DMI's checks that need the
    validated config (an ``entry`` patch): a refusal comes first, with the one-line usage and exit 2,
    not after ~750 lines of arguments."""
    from megatron.training.dmi.arguments import validate_dmi_args

    def checked_then_printed(title, args, *a, **k):
        if title == "arguments":
            with flag_refusals_as_usage_errors():
                validate_dmi_args(args)
        return print_args(title, args, *a, **k)

    return checked_then_printed


def _parse_up_front(argv: list[str], chain: Callable | None, known_only: bool) -> None:
    """``--help`` and argument errors before anything needs a GPU, with DMI's flags in the parser.

    megatron-core's first parse (``ft_integration.setup``) knows no extra provider, so its --help
    would list no --dmi-* flag; this parser is upstream's flags plus DMI's, as Megatron's own later
    parse builds it, and it stops the process (help: exit 0; bad value: exit 2) before any set-up.
    ``known_only``: another entry script's own flags are left for its own provider.
    """
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(
        prog=os.path.basename(argv[0]),
        allow_abbrev=False,
        description="Pretrain with megatron-core and Deep Model Inspection (the --dmi-* flags).",
    )
    extra_args_provider(chain)(add_megatron_arguments(parser))
    (parser.parse_known_args if known_only else parser.parse_args)(argv[1:])


def prepare_process(argv: list[str], chain: Callable | None = None, known_only: bool = False) -> None:
    """Run before megatron.training initialises: --help and argument errors, the ``entry`` patches of
    ``upstream_patches`` (wheel gaps, DMI's checks, DMI's start in ``train``), the CPU development mode.

    Args:
        argv: the process's ``sys.argv`` (CPU mode appends the flags it needs to it).
        chain: the entry script's own argument provider (as given to :func:`extra_args_provider`).
        known_only: leave flags neither Megatron nor DMI knows to the entry script's own provider.
    """
    _parse_up_front(argv, chain, known_only)
    upstream_patches.install("entry")
    if CPU_DEV_FLAG in argv:
        for flag, value in CPU_REQUIRED_FLAGS.items():
            if flag not in argv:
                argv += [flag, value]
        # A plain `python pretrain_gpt.py` is a world of one (torchrun sets these itself); NCCL_ALGO only
        # satisfies --deterministic-mode's check, gloo ignores it.
        for var, value in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("NCCL_ALGO", "Ring"),
        ):
            os.environ.setdefault(var, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        cpu_mode.enable(extra_groups=("cpu-training",))
    elif not torch.cuda.is_available():
        sys.exit(
            "error: no CUDA GPU is visible. Megatron trains on GPUs; to try DMI on this machine with a "
            f"tiny model, add {CPU_DEV_FLAG} (see README.md)."
        )


def skip_jit_warmup(warmup: Callable) -> Callable:
    """Megatron's JIT warm-up runs CUDA fusions: skipped on a CPU (a ``cpu-training`` patch)."""
    return lambda: None


def device_arch_without_connection_rule(get_device_arch_version: Callable) -> Callable:
    """Argument validation asks the GPU's compute capability when TP or CP > 1, for a
    CUDA_DEVICE_MAX_CONNECTIONS rule that needs a GPU: on a CPU, answer as a device without that
    rule (a ``cpu-training`` patch)."""
    return lambda: 10


def extra_args_provider(chain: Callable | None = None) -> Callable:
    """Adds the DMI group (and the entry script's own flags) and then any other provider."""

    def provider(parser):
        from megatron.training.dmi.arguments import add_dmi_args

        parser.usage = SHORT_USAGE
        add_dmi_args(parser)
        parser.add_argument_group("entry").add_argument(
            CPU_DEV_FLAG, action="store_true", help="run on the CPU (tiny models; gloo; for trying DMI and for CI)"
        )
        return chain(parser) if chain is not None else parser

    return provider


def train_with_dmi(train: Callable) -> Callable:
    """Megatron's training loop with DMI started when it is entered (an ``entry`` patch): the model
    chunks exist, a checkpoint (if any) is loaded, and every rank is at the same point, so the
    start-up collectives (run id and attempt from rank 0) cannot interleave with pipeline send/recv.
    It stops capturing when the loop returns (the evaluations that ``pretrain`` runs afterwards are
    not captured). With no ``--dmi-hooks`` nothing of DMI is imported or started."""

    def wrapped_train(forward_step_func, model, *args, **kwargs):
        from megatron.training import get_args

        runtime = None
        if get_args().dmi_hooks or get_args().dmi_replay_routing:  # with no DMI flag, nothing of DMI is imported
            from megatron.training.dmi.runtime import DMIRuntime

            with flag_refusals_as_usage_errors():  # the ring checked again against the device's free memory
                runtime = _one_line_on_replay_error(DMIRuntime.start, model)
        try:
            return train(forward_step_func, model, *args, **kwargs)
        finally:
            if runtime is not None:
                runtime.end_training()

    return wrapped_train


def pretrain_with_dmi(pretrain: Callable) -> Callable:
    """``megatron.training.pretrain`` with DMI around it: DMI's argument group chained before the
    caller's own ``extra_args_provider``, the caller's forward step wrapped (``dmi_forward_step``),
    and DMI closed with its end-of-run report when ``pretrain`` returns or raises. The training
    entry calls it directly; the launcher installs it in place of ``pretrain`` (a ``launch`` patch)."""
    signature = inspect.signature(pretrain)

    def pretrain_then_finish(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.arguments["forward_step_func"] = dmi_forward_step(call.arguments["forward_step_func"])
        call.arguments["extra_args_provider"] = extra_args_provider(call.arguments.get("extra_args_provider"))
        try:
            return pretrain(*call.args, **call.kwargs)
        finally:
            finish()

    pretrain_then_finish.__wrapped__ = pretrain
    return pretrain_then_finish


def dmi_forward_step(forward_step: Callable) -> Callable:
    """Wrap the user's forward step: every call tells DMI the step context (phase, iteration, model
    chunk, microbatch) from the running schedule. Before DMI started (or without DMI) it is a
    pass-through."""

    def wrapped(data_iterator, model, *args, **kwargs):
        runtime = _active_runtime()
        if runtime is not None:
            _one_line_on_replay_error(runtime.before_forward, model)
        return forward_step(data_iterator, model, *args, **kwargs)

    wrapped.__wrapped__ = forward_step
    return wrapped


def _one_line_on_replay_error(call: Callable, *args):
    """``call(*args)``; a routing-replay error (a stored run that does not fit, an iteration it lacks)
    stops the process with its one line instead of a traceback."""
    from megatron.core.dmi.replay.request import ReplayError

    try:
        return call(*args)
    except ReplayError as exc:
        raise SystemExit(f"error: {exc}") from None


def _active_runtime():
    runtime = sys.modules.get("megatron.training.dmi.runtime")
    return None if runtime is None else runtime.DMIRuntime._instance


def finish() -> None:
    """Flush and close DMI (end-of-run report). Also registered at exit, for runs that exit early."""
    runtime = sys.modules.get("megatron.training.dmi.runtime")
    if runtime is not None:
        runtime.DMIRuntime.shutdown()
