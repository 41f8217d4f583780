"""Host time DMI's capture code takes per firing, clocked around its hook sites.

An eager MoE step is host-bound (the dispatcher syncs with the host in every layer), so every host
microsecond of a hook is on the step's critical path. The clock wraps every site DMI installs: the
module forward hooks and pre-hooks it adds, the methods it wraps (the router's ``routing``, the
alltoall dispatcher's ``token_combine``) and the gradient publisher its tensor hooks call. A
wrapped method calls the model's own code inside DMI's wrapper; that inner call is clocked too and
subtracted, so each sample is DMI's own time. Samples are kept per group (``router``, ``attn``,
``resid``, ...), named after the site function that installed the hook.
"""

from __future__ import annotations

import time
from collections import defaultdict

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_GROUPS_PACKAGE = "megatron.core.dmi.hooks.groups."


def _group(fn) -> str:
    """The group of a DMI hook: the group module that defines it (``hooks/groups/<group>.py``);
    the expert-row hooks of the mlp module are ``mlp.experts``."""
    module = getattr(fn, "__module__", "") or ""
    if not module.startswith(_GROUPS_PACKAGE):
        return "other"
    group = module[len(_GROUPS_PACKAGE) :]
    outer = getattr(fn, "__qualname__", "").split(".<locals>", 1)[0]
    return "mlp.experts" if outer == "_watch_experts" else group


class HookClock:
    """Clocks DMI's hook sites on ``model``: ``before_attach`` before ``DMISession.attach``,
    ``after_attach`` after it; then ``samples[group]`` holds DMI's seconds per firing."""

    def __init__(self, model, profiler=None):
        """Nothing is wrapped until ``before_attach``. ``profiler`` (a ``cProfile.Profile``) runs
        inside DMI's own time only: enabled in the clocked sites, paused in the model's inner calls."""
        self.model = model
        self.profiler = profiler
        self.samples: dict[str, list[float]] = defaultdict(list)  # group -> DMI seconds per firing
        self._inner = 0.0
        self._known: set[tuple[int, str, int]] = set()
        self._inner_clocks: list[tuple] = []  # (object, method name, original, its inner clock)

    def _clock(self, fn, group: str | None):
        profiler = self.profiler

        def timed_call(*args, **kwargs):
            if profiler is not None:
                (profiler.disable if group is None else profiler.enable)()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if profiler is not None:
                    (profiler.enable if group is None else profiler.disable)()
                if group is None:  # the model's own method, inside DMI's wrapper
                    self._inner += dt
                else:
                    self.samples[group].append(dt - self._inner)
                    self._inner = 0.0

        timed_call.__qualname__ = getattr(fn, "__qualname__", "timed_call")
        return timed_call

    def _wrapped_methods(self):
        """The model's own methods that DMI wraps (its wrapper calls them: clocked as inner time)."""
        for m in self.model.modules():
            if isinstance(m, TopKRouter):
                yield m, "routing"
            dispatcher = getattr(m, "token_dispatcher", None)
            if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
                yield dispatcher, "token_combine"

    def before_attach(self) -> None:
        """Clock the methods DMI will wrap as inner time, and remember the hooks already there."""
        for obj, name in self._wrapped_methods():
            original = getattr(obj, name)
            clock = self._clock(original, None)
            setattr(obj, name, clock)
            self._inner_clocks.append((obj, name, original, clock))
        for m in self.model.modules():
            for dict_name in _HOOK_DICTS:
                self._known.update((id(m), dict_name, k) for k in getattr(m, dict_name))

    def after_attach(self, session=None) -> None:
        """Clock DMI's wrappers and every hook ``attach`` added; with ``session``, its gradient publisher too."""
        for obj, name, original, clock in self._inner_clocks:
            fn = getattr(obj, name)
            if fn is clock:  # DMI did not wrap it: no inner time to subtract from anything
                setattr(obj, name, original)
            else:
                setattr(obj, name, self._clock(fn, _group(fn)))
        for m in self.model.modules():
            for dict_name in _HOOK_DICTS:
                hooks = getattr(m, dict_name)
                for k, fn in list(hooks.items()):
                    if (id(m), dict_name, k) not in self._known:
                        hooks[k] = self._clock(fn, _group(fn))
        if session is not None:
            capture = session.capture
            capture.publish_gradient = self._clock(capture.publish_gradient, "grad")

    @property
    def calls(self) -> int:
        """Firings clocked so far (all groups)."""
        return sum(len(v) for v in self.samples.values())

    def take_ms(self) -> float:
        """DMI host ms since the last call (all groups), then start over."""
        ms = sum(sum(v) for v in self.samples.values()) * 1000
        self.samples.clear()
        return ms
