"""DMI sinks: where captured records go.

``open_sink`` picks the sink for a DMIConfig:

- ``--dmi-persist none``: NullSink (counts and discards)
- ``--dmi-persist spool``: SpoolSink (per-rank Parquet segments under ``<store_dir>/spool``)
- ``--dmi-persist clickhouse`` with ``--dmi-clickhouse-url``: ServerSink (every rank inserts;
  spool fallback and replay)
- ``--dmi-persist clickhouse`` without a URL: EmbeddedSink (every rank spools; the node's
  ingester loads all ranks into the embedded chDB store ``<store_dir>/chdb``)

See docs/storage.md for the tables and the multi-rank design.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.dmi.config import DMIConfig
    from megatron.core.dmi.key import ParallelCoords
    from megatron.core.dmi.sinks.sinks import DMISink

STORE_CHDB = "chdb"
STORE_SPOOL = "spool"

# Public name -> its submodule, imported on first use: a reader needs the backend and schema
# without the training-side sinks (and their imports).
_EXPORTS = {
    "backend": [
        "PASSWORD_ENV",
        "PASSWORD_FILE_ENV",
        "BackendError",
        "ChdbBackend",
        "ServerBackend",
        "ServerURLError",
        "StoreBusyError",
        "parse_server_url",
        "resolve_password",
    ],
    "base": ["Sink", "SinkReport"],
    "ingest": ["IngestResult", "IngesterThread", "ingest_spool", "load_table"],
    "meta": ["DMISinkReport", "RunInfo"],
    "schema": ["SCHEMA_VERSION", "IdentifierError", "SchemaVersionError", "check_database", "check_identifier"],
    "sinks": ["DMISink", "EmbeddedSink", "NullSink", "ServerSink", "SpoolSink"],
}
_MODULE_OF = {name: mod for mod, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def open_sink(config: DMIConfig, coords: ParallelCoords, run_id: str, is_ingester: bool) -> DMISink:
    """The sink for this process. ``is_ingester``: this process is its node's ingester (local
    rank 0); only used by the embedded store."""
    from megatron.core.dmi.sinks.backend import resolve_password
    from megatron.core.dmi.sinks.schema import check_database
    from megatron.core.dmi.sinks.sinks import EmbeddedSink, NullSink, ServerSink, SpoolSink

    check_database(config.clickhouse_database, "--dmi-clickhouse-database")
    if config.persist == "none":
        return NullSink(run_id, coords)
    store_dir = config.store_dir
    spool_root = os.path.join(store_dir, STORE_SPOOL)
    if config.persist == "spool":
        return SpoolSink(run_id, coords, spool_root)
    if config.persist != "clickhouse":
        raise ValueError(f"unknown --dmi-persist {config.persist!r} (expected clickhouse, spool or none)")
    if config.clickhouse_url:
        return ServerSink(
            config.clickhouse_url,
            run_id,
            coords,
            spool_root,
            database=config.clickhouse_database,
            password=resolve_password(config.clickhouse_password),
        )
    return EmbeddedSink(store_dir, run_id, coords, is_ingester, database=config.clickhouse_database)


__all__ = ["open_sink", *_MODULE_OF]
