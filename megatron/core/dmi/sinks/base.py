"""Sink contract: the drain thread hands batches of records (Arrow tables) to exactly one sink per process.

``write`` may be slow (it runs off the training thread) but must not lose a record it accepted:
a sink that cannot reach its database spools the batch locally and says so in its report.

A sink whose records end in spool files may instead let the native ring write its tensor
segments itself (``native_spool_target``): the drain then only relays the writer's progress
(``native_progress``) and the sink still writes metadata, drops and its report.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import pyarrow as pa

from megatron.core.dmi.errors import UnsupportedOperationError
from megatron.core.dmi.records import Record, records_to_table


@dataclass
class SinkReport:
    """What happened to every record this process handed to its sink."""

    records_written: int = 0
    bytes_written: int = 0
    records_spooled: int = 0
    bytes_spooled: int = 0
    records_dropped: int = 0
    bytes_dropped: int = 0
    errors: list[str] = field(default_factory=list)
    spooled_note: str = ""  # where the spooled records wait, and for whom ("" where nothing says more)
    store_complete_s: float | None = None  # the store held everything this long after close began (a node's ingester)


class Waiting(NamedTuple):
    """Records a store query cannot see yet: how many, how long the oldest spool segment among them
    has waited, and their bytes (in a spool writer's tensor segments, or those plus a sink's buffered
    and half-written ones)."""

    rows: int
    seconds: float
    bytes: int


class SpoolBacklog(NamedTuple):
    """This rank's spool bytes waiting for the store (written, not yet ingested or replayed and
    deleted), against their bound (``--dmi-spool-max-gb``)."""

    waiting_bytes: int
    max_bytes: int
    folder: str

    @property
    def full(self) -> bool:
        """At or past the bound: the drain stops taking records until the store catches up."""
        return self.waiting_bytes >= self.max_bytes


class Sink(ABC):
    """Where the drain hands batches of records to persist them (or the native spool writer, its target)."""

    # This process's sink runs its node's ingester, whose final pass loads every rank's spool: the
    # session closes it after every other rank's sink (a barrier between).
    is_ingester: bool = False

    @abstractmethod
    def write_table(self, table: pa.Table) -> None:
        """Persist one batch, a table in ``TENSOR_SCHEMA`` (called from the drain thread)."""

    def write(self, records: list[Record]) -> None:
        """Persist a list of records (one batch)."""
        if records:
            self.write_table(records_to_table(records))

    def flush(self) -> None:
        """Make everything written so far durable."""

    def store_lag(self) -> Waiting | None:
        """What this sink accepted that a store query cannot see yet (None: the sink has no store).
        Asked once per log line, on the training thread: a stat per waiting spool segment at most."""
        return None

    def spool_backlog(self) -> SpoolBacklog | None:
        """What waits in this sink's spool for its store, when that is bounded; None: no bound.
        The drain asks between batches, so it must be cheap (a stat per waiting segment at most)."""
        return None

    def native_spool_target(self) -> dict | None:
        """Where the native spool writer should write this sink's tensor segments (the arguments
        of ``NativeRingTransport.start_spool``), or None when the sink needs the batches itself."""
        return None

    def native_started(self, live_stats) -> None:
        """The native writer now writes this sink's tensor segments; ``live_stats()`` returns its
        current counters (None once it stopped)."""

    def native_progress(self, stats: dict, closed: list[tuple[str, int]]) -> None:
        """The native writer's counters (records, bytes, dropped_records, dropped_bytes, open_rows,
        open_bytes, errors) and the segments it closed since the last call; the last call carries the final
        counters, before ``close``."""
        raise UnsupportedOperationError(f"{type(self).__name__} does not take native spool segments")

    @abstractmethod
    def close(self) -> SinkReport:
        """Flush, release resources and return the final report."""
