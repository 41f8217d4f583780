"""Every error class DMI defines derives from DMIError, so one ``except DMIError`` catches them,
and the core raises no SystemExit: only the command line and the training entry turn errors into
exits."""

import ast
import importlib
import inspect
import pathlib
import pkgutil

import megatron.core.dmi as dmi
from megatron.core.dmi.errors import DMIError

CORE = pathlib.Path(dmi.__file__).parent


def _modules():
    for info in pkgutil.walk_packages(dmi.__path__, prefix="megatron.core.dmi."):
        if info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def _error_classes() -> set[type]:
    """Every class a module of megatron.core.dmi defines that can be raised (any BaseException,
    SystemExit and KeyboardInterrupt kinds included) or is named like an error."""
    return {
        obj
        for mod in _modules()
        for _, obj in inspect.getmembers(mod, inspect.isclass)
        if obj.__module__.startswith("megatron.core.dmi.")
        and (issubclass(obj, BaseException) or obj.__name__.endswith(("Error", "Exception")))
    }


def test_every_dmi_error_class_derives_from_dmierror():
    errors = _error_classes()
    assert len(errors) >= 15
    assert sorted(e.__qualname__ for e in errors if not issubclass(e, DMIError)) == []


def test_the_store_in_use_error_is_seen():
    """Once a SystemExit, which a filter on Exception never saw: now a DMIError like the rest."""
    from megatron.core.dmi.sinks.owner import StoreInUseError

    assert StoreInUseError in _error_classes() and not issubclass(StoreInUseError, SystemExit)


def _raises_system_exit(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "SystemExit":
                return True
    return False


def test_the_core_raises_no_system_exit():
    """Only the command line (cli/) may end the process; the core raises errors a caller can catch."""
    offenders = [
        str(p.relative_to(CORE))
        for p in sorted(CORE.rglob("*.py"))
        if p.relative_to(CORE).parts[0] != "cli" and _raises_system_exit(p)
    ]
    assert offenders == []
