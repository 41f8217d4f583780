"""Run a function in a fresh process: chDB lets a process hold one store at a time and a store be
opened by one process, so tests that touch several stores give each its own process.

Processes fork from a ``forkserver`` that has imported the DMI modules once (importing
megatron.core costs seconds), and never from a process that has a store open.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

# The packages import their names lazily: preload the modules themselves.
_PRELOAD = ["megatron.core.dmi.records", "megatron.core.dmi.sinks.sinks", "megatron.core.dmi.reader.store"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _call(fn, args, kwargs) -> bytes:
    # Plain pickle: torch's multiprocessing reducers would pass tensors through shared-memory file
    # descriptors that vanish with the process.
    return pickle.dumps(fn(*args, **kwargs))


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: float | None = 300, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a new process; returns its result or re-raises its exception."""
    with ProcessPoolExecutor(max_workers=1, mp_context=_context(), max_tasks_per_child=1) as ex:
        return pickle.loads(ex.submit(_call, fn, args, kwargs).result(timeout=timeout))


def run_parallel(calls: list[tuple[Callable[..., Any], tuple]], timeout: float | None = 300) -> list[Any]:
    """Several ``(fn, args)`` at once, each in its own new process."""
    with ProcessPoolExecutor(max_workers=len(calls), mp_context=_context(), max_tasks_per_child=1) as ex:
        futs = [ex.submit(_call, fn, args, {}) for fn, args in calls]
        return [pickle.loads(f.result(timeout=timeout)) for f in futs]
