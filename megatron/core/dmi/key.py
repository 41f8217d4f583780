"""The record key: everything that says exactly where one captured tensor came from.

A key is explicit and complete, so no stage of the pipeline ever pairs data by arrival order. It
splits into the site's part, fixed for a run (layer, output, producer coordinates, shard, shape),
and the ``Firing`` that changes with every firing of that site.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

PHASES = ("train", "valid")

# dtype name used in every table and file -> bytes per element. Only these are captured; each name
# is also torch's (torch.<name>), which is imported only where tensors are made (readers of the
# tables must not pay torch's import).
ITEM_SIZE: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "float16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "bool": 1,
}


class Firing(NamedTuple):
    """The part of a key that changes with every firing of one capture site; the rest is the
    site's own (``RecordKey.site``), fixed for the run."""

    iteration: int
    microbatch: int
    attempt: int
    phase: str
    invocation: int


SITE_FIRING = Firing(0, 0, 0, PHASES[0], 0)


@dataclass(frozen=True)
class ParallelCoords:
    """Where the producing rank sits in every parallel dimension (global rank plus group ranks)."""

    rank: int = 0
    tp: int = 0
    pp: int = 0
    vpp: int = 0
    dp: int = 0
    cp: int = 0
    ep: int = 0
    etp: int = 0

    def __post_init__(self):
        """Hash once: every firing looks its sites up by coordinates."""
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self):
        """The hash computed at construction."""
        return self._hash


@dataclass(frozen=True)
class RecordKey:
    """Everything that identifies one captured tensor.

    ``layer`` is the global 0-based transformer layer. ``token_start``/``token_end`` index dim 0 of
    the *full* tensor (tokens for router outputs, sequence positions for attention outputs) and
    ``token_total`` is that full length; ``shard_index``/``shard_count`` split the catalog's shard
    dimension (e.g. attention heads under tensor parallelism).
    """

    run_id: str
    phase: str
    iteration: int
    attempt: int
    microbatch: int
    invocation: int
    layer: int
    output: str
    coords: ParallelCoords
    shard_index: int
    shard_count: int
    token_start: int
    token_end: int
    token_total: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Payload size in bytes: the element count of ``shape`` times the dtype's item size."""
        n = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        return n * ITEM_SIZE[self.dtype]

    def site(self) -> RecordKey:
        """The site's key: this key with the firing fields at their defaults."""
        return dataclasses.replace(self, **SITE_FIRING._asdict())

    @property
    def firing(self) -> Firing:
        """The firing fields of this key: iteration, microbatch, attempt, phase and invocation."""
        return Firing(self.iteration, self.microbatch, self.attempt, self.phase, self.invocation)

    def fired(self, firing: Firing) -> RecordKey:
        """This (site) key with the fields of one firing."""
        return dataclasses.replace(self, **firing._asdict())

    def flat(self) -> dict:
        """Column values for the tables (coords flattened into their own columns)."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "coords"}
        row.update(dataclasses.asdict(self.coords))
        row["shape"] = list(self.shape)
        return row

    @classmethod
    def from_flat(cls, row: dict) -> RecordKey:
        """The key of a table row, the inverse of ``flat`` (coords gathered back, ``shape`` a tuple)."""
        coords = ParallelCoords(**{f.name: int(row[f.name]) for f in dataclasses.fields(ParallelCoords)})
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name == "coords":
                continue
            v = row[f.name]
            kwargs[f.name] = tuple(int(x) for x in v) if f.name == "shape" else v
        return cls(coords=coords, **kwargs)
