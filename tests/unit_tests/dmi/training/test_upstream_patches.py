"""Every run-time replacement of megatron-core's or megatron.training's attributes is a row of
``upstream_patches.TARGETS``: each target exists in the pinned wheel, and ``restore`` puts every
original back, whatever the groups installed."""

import importlib.metadata
import inspect
import re

import pytest

from megatron.core.dmi import upstream_patches
from megatron.core.dmi.upstream_patches import GROUPS, TARGETS, install, owner_and_name, restore
from tests.functional_tests.launch import REPO


def _originals() -> dict:
    out = {}
    for target in TARGETS:
        owner, name = owner_and_name(target)
        out[target] = (owner, name, inspect.getattr_static(owner, name))
    return out


def test_the_table_is_read_against_the_pinned_megatron_core():
    with open(f"{REPO}/pyproject.toml", encoding="utf-8") as f:
        (pinned,) = re.findall(r'"megatron-core==([^"]+)"', f.read())
    assert importlib.metadata.version("megatron-core") == pinned


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t.group}:{t.module}.{t.attribute}")
def test_every_target_exists_in_the_wheel_and_has_its_replacement(target):
    owner, name = owner_and_name(target)
    assert hasattr(owner, name), f"{target.module}.{target.attribute} is gone: review this row"
    assert callable(upstream_patches._resolve(target.replacement))
    assert target.why


def test_every_group_replaces_its_targets_and_restore_puts_every_original_back():
    originals = _originals()
    try:
        for group in GROUPS:
            install(group)
        for target, (owner, name, original) in originals.items():
            assert inspect.getattr_static(owner, name) is not original, f"{target} not replaced"
    finally:
        restore()
    for target, (owner, name, original) in originals.items():
        assert inspect.getattr_static(owner, name) is original, f"{target} not restored"
    assert upstream_patches._installed == []


def test_a_group_installs_once_and_restores_only_itself():
    originals = _originals()
    try:
        install("entry")
        install("entry")  # idempotent: a second install must not stack over the first
        install("runtime")
        restore("entry")
        for target, (owner, name, original) in originals.items():
            replaced = inspect.getattr_static(owner, name) is not original
            assert replaced == (target.group == "runtime"), target
    finally:
        restore()
    assert all(inspect.getattr_static(o, n) is orig for o, n, orig in originals.values())


def test_an_unknown_group_is_refused_naming_the_groups():
    with pytest.raises(ValueError, match="unknown group 'cpu_mode'; the groups are cpu, cpu-training, entry"):
        install("cpu_mode")
