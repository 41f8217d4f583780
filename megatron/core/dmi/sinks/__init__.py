"""DMI sinks: where captured records go.

``open_sink`` picks the sink for a DMIConfig:

- ``--dmi-persist none``: NullSink (counts and discards)
- ``--dmi-persist spool``: SpoolSink (per-rank segments under ``<store_dir>/spool``)
- ``--dmi-persist clickhouse``: StoreSink (every rank spools; the node's ingester process loads
  all ranks into the embedded chDB store ``<store_dir>/chdb``, or with ``--dmi-clickhouse-url``
  into that server; ``--dmi-ingest-threads``: chDB's threads, or parallel inserts into the server)

Sinks write through the store package (``megatron.core.dmi.store``: schema, backends, segment
formats, ingest); see docs/storage.md for the tables and the multi-rank design.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megatron.core.dmi.sinks.base import Sink, SinkReport
from megatron.core.dmi.sinks.meta import DMISinkReport, RunInfo
from megatron.core.dmi.sinks.sinks import DMISink, NullSink, SpoolSink, StoreSink
from megatron.core.dmi.store_address import check_database, resolve_password

if TYPE_CHECKING:  # config imports torch; writing and reading segments do not need it
    from megatron.core.dmi.config import DMIConfig
    from megatron.core.dmi.key import ParallelCoords

STORE_SPOOL = "spool"


def open_sink(config: DMIConfig, coords: ParallelCoords, run_id: str, is_ingester: bool) -> DMISink:
    """The sink for this process. ``is_ingester``: this process is its node's ingester (local
    rank 0), which starts the store's ingester process."""
    check_database(config.clickhouse_database, "--dmi-clickhouse-database")
    if config.persist == "none":
        return NullSink(run_id, coords)
    store_dir = config.store_dir
    spool_root = os.path.join(store_dir, STORE_SPOOL)
    if config.persist == "spool":
        return SpoolSink(run_id, coords, spool_root)
    if config.persist != "clickhouse":
        from megatron.core.dmi.config import ConfigValueError

        raise ConfigValueError(f"unknown --dmi-persist {config.persist!r} (expected clickhouse, spool or none)")
    return StoreSink(
        store_dir,
        run_id,
        coords,
        is_ingester,
        database=config.clickhouse_database,
        ingest_threads=config.ingest_threads,
        ingest_nice=config.ingest_nice,
        codec=config.store_codec,
        url=config.clickhouse_url,
        password=resolve_password(config.clickhouse_password) if config.clickhouse_url else None,
        spool_max_bytes=config.spool_max_bytes,
    )


__all__ = [
    "DMISink",
    "DMISinkReport",
    "NullSink",
    "RunInfo",
    "Sink",
    "SinkReport",
    "SpoolSink",
    "StoreSink",
    "open_sink",
]
