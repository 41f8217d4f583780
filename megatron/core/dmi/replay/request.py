"""What a rank asks the extraction for, and the file it gets back: shared by both sides."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from megatron.core.dmi.errors import DMIError


class ReplayError(DMIError):
    """Routing replay cannot go on: the training entry stops with its one-line message."""


class ReplaySourceError(ReplayError, ValueError):
    """The stored run cannot be replayed by this run (the message names what differs)."""


class ReplayMissingError(ReplayError, RuntimeError):
    """The replaying run reached an iteration the stored run holds no routing for."""


@dataclass
class ReplayRequest:
    """This rank's share of the replay: which layers and tokens, and the facts the stored run must match."""

    store: str
    run: str | None
    layers: list[int]  # global 0-based layers of this rank's routers
    dp: int
    dp_size: int
    tp: int
    tp_size: int
    sequence_parallel: bool
    microbatches: int  # per iteration, on this rank
    # the replaying model's facts, by the names of the stored model summary
    facts: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> str:
        """The request as the extraction subprocess reads it."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ReplayRequest:
        """The request written by ``to_json``."""
        return cls(**json.loads(text))


def index_path(out: str) -> str:
    """Where the extraction writes the index beside its ``.npy`` array."""
    return os.path.splitext(out)[0] + ".json"
