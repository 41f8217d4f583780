"""What pretrain_gpt.py needs from DMI: process preparation, the argument provider and the
forward-step wrapper that activates DMI inside ``megatron.training.pretrain``."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable

import torch

CPU_DEV_FLAG = "--cpu-dev-mode"
# Upstream's usage line lists every one of its ~1000 flags (about 640 lines) before each argument
# error; ours names the kinds of flags and where the full list is.
SHORT_USAGE = "%(prog)s [Megatron arguments] [--dmi-* arguments] [--cpu-dev-mode]  (all flags: %(prog)s --help)"
# Flags the CPU mode needs because megatron-core cannot honour them on a CPU (see cpu_mode.py).
CPU_REQUIRED_FLAGS = {"--clip-grad": "0", "--num-workers": "0", "--distributed-backend": "gloo"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships helpers_cpp prebuilt but no Makefile, so upstream's
    compile_helpers() (which runs make) fails. When the module imports, building is unnecessary."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout with a Makefile: keep upstream's build step
    dataset_utils.compile_helpers = lambda: None


def _validate_dmi_after_megatron() -> None:
    """DMI checks that need the full Megatron config run inside Megatron's own validation, so bad
    input still fails before any process group or model exists."""
    import megatron.training.initialize as mt_init

    from megatron.training.dmi.arguments import check_dmi_layout, validate_dmi_args

    validate_args = mt_init.validate_args

    def validate(args, *a, **k):
        check_dmi_layout(args)
        out = validate_args(args, *a, **k)
        validate_dmi_args(args)
        return out

    mt_init.validate_args = validate


def _parse_up_front(argv: list[str]) -> None:
    """``--help`` and argument errors before anything needs a GPU, with DMI's flags in the parser.

    megatron-core's first parse (``ft_integration.setup``) knows no extra provider, so its --help
    would list no --dmi-* flag; this parser is upstream's flags plus DMI's, as Megatron's own later
    parse builds it, and it stops the process (help: exit 0; bad value: exit 2) before any set-up.
    """
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(
        prog=os.path.basename(argv[0]),
        allow_abbrev=False,
        description="Pretrain a GPT with megatron-core and Deep Model Inspection (the --dmi-* flags).",
    )
    extra_args_provider()(add_megatron_arguments(parser))
    parser.parse_args(argv[1:])


def prepare_process(argv: list[str]) -> None:
    """Run before megatron.training initialises: --help and argument errors, wheel gaps, DMI
    validation, the CPU development mode."""
    _parse_up_front(argv)
    _use_prebuilt_dataset_helpers()
    _validate_dmi_after_megatron()
    if CPU_DEV_FLAG in argv:
        from megatron.core.dmi import cpu_mode

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
        cpu_mode.enable(extra_patches=_cpu_training_patches())
    elif not torch.cuda.is_available():
        sys.exit(
            "error: no CUDA GPU is visible. Megatron trains on GPUs; to try DMI on this machine with a "
            f"tiny model, add {CPU_DEV_FLAG} (see README.md)."
        )


def _cpu_training_patches() -> list[tuple[object, str, object]]:
    """What ``megatron.training`` needs on top of the core CPU shim."""
    import megatron.training.arguments as mt_arguments
    import megatron.training.initialize as mt_init

    return [
        (mt_init, "_warmup_jit_function", lambda: None),
        # Argument validation asks the GPU's compute capability when TP or CP > 1 (for a
        # CUDA_DEVICE_MAX_CONNECTIONS rule that needs a GPU): answer as a device without that rule.
        (mt_arguments, "get_device_arch_version", lambda: 10),
    ]


def compute_device() -> torch.device:
    """The device training computes on: the CPU in CPU mode, else the current CUDA device."""
    from megatron.core.dmi import cpu_mode

    return torch.device("cpu") if cpu_mode.enabled() else torch.device("cuda", torch.cuda.current_device())


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


def _wrap_train_loop() -> None:
    """DMI starts when ``megatron.training.training.train`` is entered: the model chunks exist, a
    checkpoint (if any) is loaded, and every rank is at the same point, so the start-up collectives
    (run id and attempt from rank 0) cannot interleave with pipeline send/recv. It stops capturing
    when the loop returns (the evaluations that ``pretrain`` runs afterwards are not captured)."""
    import megatron.training.training as mt_training

    if getattr(mt_training.train, "_dmi_wrapped", False):
        return
    train = mt_training.train

    def wrapped_train(forward_step_func, model, *args, **kwargs):
        from megatron.training import get_args

        runtime = None
        if get_args().dmi_hooks or get_args().dmi_replay_routing:  # with no DMI flag, nothing of DMI is imported
            from megatron.training.dmi.runtime import DMIRuntime

            runtime = _one_line_on_replay_error(DMIRuntime.start, model)
        try:
            return train(forward_step_func, model, *args, **kwargs)
        finally:
            if runtime is not None:
                runtime.end_training()

    wrapped_train._dmi_wrapped = True
    wrapped_train.__wrapped__ = train
    mt_training.train = wrapped_train


def dmi_forward_step(forward_step: Callable) -> Callable:
    """Wrap the user's forward step: every call tells DMI the step context (phase, iteration, model
    chunk, microbatch) from the running schedule. Before DMI started (or without DMI) it is a
    pass-through."""
    _wrap_train_loop()

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
