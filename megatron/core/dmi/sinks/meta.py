"""Run metadata handed to sinks (RunInfo) and its Arrow encodings for the runs/topology/drops/
reports tables."""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.provenance import package_versions, scrub_command_line
from megatron.core.dmi.sinks.base import SinkReport
from megatron.core.dmi.store import schema as S


@dataclass
class DMISinkReport(SinkReport):
    """SinkReport plus what the concrete sinks also know.

    Every tensor record a sink accepts ends in exactly one of: written (read back from the store by
    its ingester, or in a spool segment with ``--dmi-persist spool``), spooled (in spool segments
    the store has not taken yet, e.g. while its server is down: an ingester or ``load`` loads them
    later), dropped (lost, e.g. disk full), discarded (``--dmi-persist none``).
    """

    sink: str = ""
    records_discarded: int = 0
    bytes_discarded: int = 0
    segments_ingested: int = 0  # ingester: spool segments of all ranks loaded by this process
    segments_corrupt: int = 0
    drops_recorded: int = 0  # keys of records lost upstream (ring full) written to the drops table

    def summary(self) -> str:
        """The report's counts as one line: written, spooled and dropped, then discarded and errors where any."""
        s = (
            f"written {self.records_written} ({self.bytes_written / 2**20:.1f} MiB), "
            f"spooled {self.records_spooled}, dropped {self.records_dropped}"
        )
        if self.records_discarded:
            s += f", discarded {self.records_discarded}"
        if self.errors:
            s += f", {len(self.errors)} error(s)"
        return s


@dataclass
class RunInfo:
    """What a rank tells its sink about the run at start-up (``Sink.write_run``).

    ``attempt`` starts at 1 and grows by one on every resume; ``resumed_from_iteration`` is the
    checkpoint iteration an attempt continues from (None for a fresh start): records of earlier
    attempts for later iterations are superseded. ``coords``/``layers`` are this rank's topology
    row (global 0-based layer numbers it holds). ``model``, ``layout`` and ``command_line`` make the
    store readable without the training command (``megatron.core.dmi.provenance``).
    """

    run_id: str
    attempt: int
    resumed_from_iteration: int | None
    config: dict[str, Any]
    versions: dict[str, str] = field(default_factory=package_versions)
    model: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    command_line: Sequence[str] = ()
    coords: ParallelCoords = field(default_factory=ParallelCoords)
    layers: Sequence[int] = ()
    world_size: int = 1
    hostname: str = field(default_factory=socket.gethostname)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))


_SECRET_KEYS = ("password", "passwd", "secret", "credential", "api_key")


def scrub_secrets(obj: Any) -> Any:
    """Copy of ``obj`` with every value under a password-like key replaced (the runs table must
    never hold credentials, e.g. DMIConfig.clickhouse_password)."""
    if isinstance(obj, dict):
        return {
            k: ("***" if v and any(s in str(k).lower() for s in _SECRET_KEYS) else scrub_secrets(v))
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [scrub_secrets(v) for v in obj]
    return obj


def _json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o))


def runs_table(info: RunInfo) -> pa.Table:
    """The ``runs`` row of one attempt."""
    return pa.Table.from_pylist(
        [
            {
                "run_id": info.run_id,
                "attempt": int(info.attempt),
                "resumed_from_iteration": -1
                if info.resumed_from_iteration is None
                else int(info.resumed_from_iteration),
                "started_at": info.started_at,
                "rank": int(info.coords.rank),
                "world_size": int(info.world_size),
                "hostname": info.hostname,
                "config_json": _json(scrub_secrets(info.config)),
                "versions_json": _json(info.versions),
                "model_json": _json(info.model),
                "layout_json": _json(info.layout),
                "command_line": scrub_command_line(info.command_line),
            }
        ],
        schema=S.RUNS_SCHEMA,
    )


def topology_table(info: RunInfo) -> pa.Table:
    """The ``topology`` row of one rank of one attempt."""
    row = {
        "run_id": info.run_id,
        "attempt": int(info.attempt),
        "layers": [int(x) for x in info.layers],
        "hostname": info.hostname,
    }
    row.update({k: int(v) for k, v in dataclasses.asdict(info.coords).items()})
    return pa.Table.from_pylist([row], schema=S.TOPOLOGY_SCHEMA)


def drops_table(items: Sequence[tuple[RecordKey, str, datetime]]) -> pa.Table:
    """The ``drops`` rows: each dropped record's key, why and when."""
    cols: dict[str, list] = {n: [] for n in S.DROPS_SCHEMA.names}
    for key, reason, when in items:
        for k, v in key.flat().items():
            cols[k].append(v)
        cols["reason"].append(reason)
        cols["dropped_at"].append(when)
    return pa.Table.from_pydict(cols, schema=S.DROPS_SCHEMA)


def report_table(run_id: str, attempt: int, rank: int, report: DMISinkReport) -> pa.Table:
    """The ``reports`` row of one rank's end-of-run sink report."""
    return pa.Table.from_pylist(
        [
            {
                "run_id": run_id,
                "attempt": int(attempt),
                "rank": int(rank),
                "sink": report.sink,
                "records_written": report.records_written,
                "bytes_written": report.bytes_written,
                "records_spooled": report.records_spooled,
                "bytes_spooled": report.bytes_spooled,
                "records_dropped": report.records_dropped,
                "bytes_dropped": report.bytes_dropped,
                "errors": [e[:2000] for e in report.errors[:100]],
                "closed_at": datetime.now(UTC),
            }
        ],
        schema=S.REPORTS_SCHEMA,
    )
