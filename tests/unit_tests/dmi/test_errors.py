"""Every error class DMI defines derives from DMIError, so one ``except DMIError`` catches them."""

import importlib
import inspect
import pkgutil

import megatron.core.dmi as dmi
from megatron.core.dmi.errors import DMIError


def _modules():
    for info in pkgutil.walk_packages(dmi.__path__, prefix="megatron.core.dmi."):
        if info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def test_every_dmi_error_class_derives_from_dmierror():
    errors = {
        obj
        for mod in _modules()
        for _, obj in inspect.getmembers(mod, inspect.isclass)
        if obj.__module__.startswith("megatron.core.dmi.") and issubclass(obj, Exception)
    }
    assert len(errors) >= 10
    assert not [e.__qualname__ for e in errors if not issubclass(e, DMIError)]
