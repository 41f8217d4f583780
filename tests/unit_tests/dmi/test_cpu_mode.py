"""``cpu_mode.disable()`` leaves the process as ``enable()`` found it: every torch and megatron
attribute it replaced (its own and the groups it was asked for) is the original object again, its
device mode is off, and the logger level it raised is back."""

import inspect
import logging

import torch

from megatron.core.dmi import cpu_mode, upstream_patches


def _targets() -> list[tuple[object, str]]:
    torch_targets = [(owner, name) for owner, name, _ in cpu_mode._torch_patches()]
    table_targets = [
        upstream_patches.owner_and_name(t) for t in upstream_patches.TARGETS if t.group in ("cpu", "cpu-training")
    ]
    return torch_targets + table_targets


def _state(owner, name):
    try:
        return inspect.getattr_static(owner, name)
    except AttributeError:  # torch._dynamo.config serves its values dynamically
        return getattr(owner, name)


def test_disable_restores_everything_enable_replaced():
    targets = _targets()
    before = [_state(owner, name) for owner, name in targets]
    modes_before = len(torch.overrides._get_current_function_mode_stack())
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    level_before = logger.level
    cpu_mode.enable(extra_groups=("cpu-training",))
    try:
        assert cpu_mode.enabled()
        assert torch.zeros(2, device="cuda").device.type == "cpu"  # the device mode is on
        assert torch.cuda.is_available()
        replaced = [(o, n) for (o, n), b in zip(targets, before) if _state(o, n) is not b]
        assert replaced == targets
    finally:
        cpu_mode.disable()
    assert not cpu_mode.enabled()
    after = [_state(owner, name) for owner, name in targets]
    assert [(o, n) for (o, n), b, a in zip(targets, before, after) if a is not b and a != b] == []
    assert len(torch.overrides._get_current_function_mode_stack()) == modes_before
    assert logger.level == level_before
    assert upstream_patches._installed == []
    cpu_mode.disable()  # a second disable is harmless
