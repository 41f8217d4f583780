"""Host time DMI's capture code takes per firing, clocked around its hook sites.

An eager MoE step is host-bound (the dispatcher syncs with the host in every layer), so every host
microsecond of a hook is on the step's critical path. The clock wraps DMI's sites (outer: the
router wrapper and the core-attention forward hooks) and the router's own ``routing`` inside
DMI's wrapper (inner); DMI's own time per router firing is outer minus inner. Each call is kept,
per site kind, so medians and spreads can be reported.
"""

from __future__ import annotations

import time
from collections import defaultdict

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer


class HookClock:
    def __init__(self, model):
        self.model = model
        self.samples: dict[str, list[float]] = defaultdict(list)  # kind -> DMI seconds per firing
        self._inner = 0.0

    def _clock(self, fn, kind: str | None):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if kind is None:  # the router's own routing, inside DMI's wrapper
                    self._inner += dt
                else:
                    self.samples[kind].append(dt - self._inner)
                    self._inner = 0.0

        return timed_call

    def routers(self):
        return [m for m in self.model.modules() if isinstance(m, TopKRouter)]

    def before_attach(self) -> None:
        for r in self.routers():  # DMI's wrapper will call this clocked routing as its original
            r.routing = self._clock(r.routing, None)

    def after_attach(self) -> None:
        for r in self.routers():
            r.routing = self._clock(r.routing, "router")
        for m in self.model.modules():
            if isinstance(m, TransformerLayer):
                hooks = m.self_attention.core_attention._forward_hooks
                for k, fn in list(hooks.items()):
                    hooks[k] = self._clock(fn, "attn")

    @property
    def calls(self) -> int:
        return sum(len(v) for v in self.samples.values())

    def take_ms(self) -> float:
        """DMI host ms since the last call (all kinds), then start over."""
        ms = sum(sum(v) for v in self.samples.values()) * 1000
        self.samples.clear()
        return ms
