"""Hooks: attach capture points to megatron-core modules without editing the installed wheel."""

from megatron.core.dmi.hooks.install import HookSet

__all__ = ["HookSet"]
