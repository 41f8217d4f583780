"""Sink contract: the drain thread hands batches of records to exactly one sink per process.

``write`` may be slow (it runs off the training thread) but must not lose a record it accepted:
a sink that cannot reach its database spools the batch locally and says so in its report.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from megatron.core.dmi.records import Record


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


class Sink(ABC):
    @abstractmethod
    def write(self, records: list[Record]) -> None:
        """Persist one batch (called from the drain thread)."""

    def flush(self) -> None:
        """Make everything written so far durable."""

    @abstractmethod
    def close(self) -> SinkReport:
        """Flush, release resources and return the final report."""
