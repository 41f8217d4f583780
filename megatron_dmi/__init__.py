"""The ``megatron-dmi`` command (and ``python -m megatron_dmi``): the DMI command line without
importing megatron-core.

Python runs a package's ``__init__`` before it imports any module inside it, and
``megatron/core/__init__.py`` (the megatron-core wheel's) imports torch and most of megatron-core:
about 6 s and a page of CUDA/absl/Transformer Engine/apex warnings before
``python -m megatron.core.dmi`` reaches its first line. The reading commands need none of it, so
this entry point registers ``megatron.core`` as a bare package (its search path, not its code)
before importing the CLI (``open_store`` does the same for Python readers). That ``__init__`` only re-exports names (``Timers``, ``parallel_state``
...): the first time anything asks the bare package for a name it lacks, it runs the real
``__init__`` then, so a command that needs megatron-core (``doctor``) still gets all of it.
"""

from __future__ import annotations

import importlib.util
import sys

CORE = "megatron.core"


def register_bare_core() -> None:
    """Make ``import megatron.core.dmi...`` skip megatron-core's package ``__init__`` until a name of it is used
    (scripts that read stores call this before their DMI imports; a no-op once megatron.core is imported)."""
    if CORE in sys.modules:
        return
    spec = importlib.util.find_spec(CORE)  # imports `megatron`, a namespace package (no code)
    if spec is None or spec.submodule_search_locations is None:
        return
    bare = importlib.util.module_from_spec(spec)  # not executed

    def complete(name: str):
        del bare.__getattr__
        spec.loader.exec_module(bare)
        return getattr(bare, name)

    bare.__getattr__ = complete
    sys.modules[CORE] = bare
    sys.modules["megatron"].core = bare


def open_store(path_or_url: str, **kwargs):
    """``megatron.core.dmi.reader.open_store`` for scripts and notebooks, without megatron-core's import (its
    seconds and its Transformer Engine/Apex/CUDA notices): ``with megatron_dmi.open_store("dmi_store/x") as s:``."""
    register_bare_core()
    from megatron.core.dmi.reader import open_store as open_

    return open_(path_or_url, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """The ``megatron-dmi`` command line, without paying megatron.core's import."""
    register_bare_core()
    from megatron.core.dmi.cli import main as cli_main

    return cli_main(argv, prog="megatron-dmi")
