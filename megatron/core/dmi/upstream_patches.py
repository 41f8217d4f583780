"""Every place where DMI replaces something of megatron-core's or ``megatron.training``'s at run time.

DMI changes nothing in the megatron-core wheel on disk; where it needs a hook that Megatron does not
offer, it replaces a module attribute for the life of the process (or of a test). Each of those
replacements is one row of ``TARGETS``: the group that installs it, the module and attribute
replaced, the function that builds the replacement from the original, and why. A megatron-core bump
is then this table to review (``tests/unit_tests/dmi/training/test_upstream_patches.py`` checks that
every target still exists in the installed wheel and that ``restore`` puts every original back).

Groups, each installed as a whole by ``install`` and undone by ``restore``:

* ``cpu``: megatron-core on a CPU (``cpu_mode.enable``; its torch replacements join this group);
* ``cpu-training``: what ``megatron.training`` needs on a CPU on top of ``cpu``;
* ``entry``: the training entry's hooks around ``pretrain`` (``entry.prepare_process``);
* ``launch``: DMI inside another entry script (``python -m megatron.training.dmi.launch``);
* ``runtime``: a running DMI session's hooks in the training loop (``DMIRuntime``).

Modules and replacement builders are named by their dotted paths and imported only when their
group is installed, so this module imports nothing of ``megatron.training``: the ``cpu`` group
serves loops built on megatron-core alone, and the other groups are installed only by
``megatron.training.dmi``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from megatron.core.dmi.errors import InvalidArgumentError

_CPU = "megatron.core.dmi.cpu_mode"
_ENTRY = "megatron.training.dmi.entry"
_RUNTIME = "megatron.training.dmi.runtime"


@dataclass(frozen=True)
class Target:
    """One replaced attribute: ``module.attribute`` (``attribute`` may be ``Class.name``) becomes
    ``replacement(original)``, where ``replacement`` is ``"module:function"``."""

    group: str
    module: str
    attribute: str
    replacement: str
    why: str


TARGETS: tuple[Target, ...] = (
    Target(
        "cpu",
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        f"{_CPU}:cpu_rng_state",
        "the tensor-parallel RNG tracker keeps CUDA generator states; on a CPU, the CPU generator's",
    ),
    Target(
        "cpu",
        "megatron.core.tensor_parallel.random",
        "_set_cuda_rng_state",
        f"{_CPU}:set_cpu_rng_state",
        "the counterpart of _get_cuda_rng_state",
    ),
    Target(
        "cpu",
        "megatron.core.tensor_parallel.random",
        "CheckpointFunction.backward",
        f"{_CPU}:backward_with_cpu_mode",
        "activation recompute replays forward code inside backward, where the CPU device mode is off",
    ),
    Target(
        "cpu",
        "megatron.core.tensor_parallel.random",
        "CheckpointWithoutOutput._recompute",
        f"{_CPU}:recompute_with_cpu_mode",
        "the same, for output-discarding checkpoints",
    ),
    Target(
        "cpu",
        "megatron.core.transformer.torch_norm",
        "WrappedTorchNorm.__new__",
        f"{_CPU}:torch_norm_with_sequence_parallel",
        "without TE or apex the local spec's torch norm is refused under sequence parallelism",
    ),
    Target(
        "cpu-training",
        "megatron.training.initialize",
        "_warmup_jit_function",
        f"{_ENTRY}:skip_jit_warmup",
        "the JIT warm-up runs CUDA fusions",
    ),
    Target(
        "cpu-training",
        "megatron.training.arguments",
        "get_device_arch_version",
        f"{_ENTRY}:device_arch_without_connection_rule",
        "argument validation asks the GPU's compute capability when TP or CP > 1",
    ),
    Target(
        "entry",
        "megatron.core.datasets.utils",
        "compile_helpers",
        f"{_ENTRY}:prebuilt_dataset_helpers",
        "the wheel ships helpers_cpp prebuilt but no Makefile, so upstream's build step fails",
    ),
    Target(
        "entry",
        "megatron.training.initialize",
        "validate_args",
        f"{_ENTRY}:validate_args_with_dmi_layout",
        "layouts DMI cannot capture are refused before Megatron's own checks",
    ),
    Target(
        "entry",
        "megatron.training.arguments",
        "_print_args",
        f"{_ENTRY}:dmi_checks_before_argument_dump",
        "DMI's checks that need the validated config run before Megatron prints its ~750-line dump",
    ),
    Target(
        "entry",
        "megatron.training.training",
        "train",
        f"{_ENTRY}:train_with_dmi",
        "DMI starts when the loop is entered (model built, checkpoint loaded, every rank at one point)",
    ),
    Target(
        "launch",
        "megatron.training",
        "pretrain",
        f"{_ENTRY}:pretrain_with_dmi",
        "another entry script's pretrain call gets DMI's flags and forward-step wrapper",
    ),
    Target(
        "launch",
        "megatron.training.training",
        "pretrain",
        f"{_ENTRY}:pretrain_with_dmi",
        "the same, for scripts that import it from megatron.training.training",
    ),
    Target(
        "runtime",
        "megatron.training.training",
        "save_checkpoint",
        f"{_RUNTIME}:save_checkpoint_with_dmi_state",
        "DMI flushes and writes its run identity before Megatron writes checkpoint N",
    ),
    Target(
        "runtime",
        "megatron.training.training",
        "training_log",
        f"{_RUNTIME}:training_log_with_dmi",
        "DMI's log line and TensorBoard/W&B scalars at the log interval",
    ),
)

GROUPS = tuple(dict.fromkeys(t.group for t in TARGETS))

# (group, owner, name, original as stored on the owner), in the order of installation.
_installed: list[tuple[str, object, str, object]] = []


def _resolve(dotted: str):
    """The object a ``"module:function"`` or a ``module`` + ``Class.name`` path names."""
    module, _, rest = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in rest.split(".") if rest else ():
        obj = getattr(obj, part)
    return obj


def owner_and_name(target: Target) -> tuple[object, str]:
    """The object that holds ``target``'s attribute (its module, or a class in it), and the name."""
    owner_path, _, name = target.attribute.rpartition(".")
    return _resolve(f"{target.module}:{owner_path}" if owner_path else target.module), name


def replace(group: str, owner: object, name: str, value: object) -> None:
    """Set ``owner.name`` to ``value``, keeping the original for ``restore(group)``."""
    try:
        original = inspect.getattr_static(owner, name)  # keeps staticmethods intact
    except AttributeError:  # config modules serve attributes dynamically
        original = getattr(owner, name)
    _installed.append((group, owner, name, original))
    setattr(owner, name, value)


def installed(group: str) -> bool:
    """Whether ``group`` is installed in this process."""
    return any(g == group for g, *_ in _installed)


def install(group: str) -> None:
    """Install every target of ``group`` (idempotent).

    Args:
        group: one of ``GROUPS``.

    Raises:
        ValueError: ``group`` is not one of ``GROUPS``.
    """
    if group not in GROUPS:
        raise InvalidArgumentError(f"unknown group {group!r}; the groups are {', '.join(GROUPS)}")
    if installed(group):
        return
    for target in TARGETS:
        if target.group == group:
            owner, name = owner_and_name(target)
            replace(group, owner, name, _resolve(target.replacement)(getattr(owner, name)))


def restore(group: str | None = None) -> None:
    """Put back every original that ``group`` (or, with None, any group) replaced, newest first."""
    for index in range(len(_installed) - 1, -1, -1):
        entry_group, owner, name, original = _installed[index]
        if group is None or entry_group == group:
            del _installed[index]
            setattr(owner, name, original)
