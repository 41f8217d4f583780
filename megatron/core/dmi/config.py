"""DMIConfig: every DMI setting in one dataclass, built from the --dmi-* flags or directly."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from megatron.core.dmi.errors import DMIError


class LayerRangeError(DMIError, ValueError):
    pass


def parse_layers(spec: str | None) -> frozenset[int] | None:
    """``0,4-7`` -> {0,4,5,6,7}; None or ``all`` -> None (every layer). Layers are global, 0-based."""
    if spec is None or spec.strip() == "all":
        return None
    layers: set[int] = set()
    for item in (s.strip() for s in spec.split(",")):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LayerRangeError(f"malformed layer range {item!r} in {spec!r} (expected e.g. 0,4-7)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise LayerRangeError(f"empty layer range {item!r} in {spec!r} (end before start)")
        layers.update(range(a, b + 1))
    return frozenset(layers)


class RunIdError(DMIError, ValueError):
    pass


# A run id names a folder under the store (attempts/<run id>): one path component that can never be
# ".", "..", hidden or read as an option, and never holds a separator.
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise RunIdError(
            f"run id must be 1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit, got {str(run_id)[:140]!r}"
        )
    return run_id


@dataclass
class DMIConfig:
    hooks: frozenset[str] = frozenset()
    persist: Literal["clickhouse", "spool", "none"] = "clickhouse"
    store_dir: str = "dmi_store"
    clickhouse_url: str | None = None
    clickhouse_database: str = "dmi"
    clickhouse_password: str | None = field(default=None, repr=False)
    interval: int = 1
    start_iter: int = 1
    end_iter: int | None = None
    layers: frozenset[int] | None = None
    phases: frozenset[str] = frozenset({"train"})
    ring_mb: float = 64.0
    on_full: Literal["block", "drop"] = "block"
    transport: Literal["auto", "native", "torch"] = "auto"
    record_replays: bool = False
    run_id: str | None = None
    flush_records: int = 256  # drain hands the sink batches of at most this many records
    logits_topk: int = 8  # k of the logits.topk output

    def __post_init__(self):
        if self.run_id is not None:
            check_run_id(self.run_id)

    @property
    def enabled(self) -> bool:
        return bool(self.hooks)

    @property
    def ring_bytes(self) -> int:
        return int(self.ring_mb * (1 << 20))

    def captures_iteration(self, phase: str, iteration: int) -> bool:
        """Iterations are 1-based, as in Megatron's training log."""
        if phase not in self.phases:
            return False
        if iteration < self.start_iter or (self.end_iter is not None and iteration > self.end_iter):
            return False
        return (iteration - self.start_iter) % self.interval == 0

    def captures_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers
