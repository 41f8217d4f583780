"""The DMI store schema: one place that renders the ClickHouse DDL and the Arrow schemas.

Both the embedded chDB store and a ClickHouse server use exactly this SQL, and every table is fed
with Arrow tables of exactly these schemas (spool segments are Parquet files of the same schemas),
so the two paths cannot drift apart.

Bump ``SCHEMA_VERSION`` whenever a table or column changes; a store of another version is refused
with an error naming both versions.
"""

from __future__ import annotations

import pyarrow as pa

from megatron.core.dmi.errors import DMIError, InvalidArgumentError
from megatron.core.dmi.records import COORD_COLUMNS, KEY_COLUMNS, TENSOR_SCHEMA
from megatron.core.dmi.store_address import check_identifier

SCHEMA_VERSION = 2
DEFAULT_DATABASE = "dmi"


class SchemaVersionError(DMIError, RuntimeError):
    """The store was written with another DMI schema version."""


def qualified(database: str, table: str) -> str:
    """``database.table``, both checked as identifiers."""
    return f"{check_identifier(database, 'database name')}.{check_identifier(table, 'table name')}"


# --------------------------------------------------------------------------------------------
# Arrow schemas of the non-tensor kinds (spool segments and inserts)
# --------------------------------------------------------------------------------------------

_TS = pa.timestamp("ms", tz="UTC")

RUNS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("attempt", pa.int32()),
        ("resumed_from_iteration", pa.int64()),  # -1: a fresh start
        ("started_at", _TS),
        ("rank", pa.int32()),  # the rank that wrote this row (every rank writes one; they collapse)
        ("world_size", pa.int32()),
        ("hostname", pa.string()),
        ("config_json", pa.string()),  # the DMI config (secrets scrubbed)
        ("versions_json", pa.string()),
        ("model_json", pa.string()),  # the model configuration captured outputs depend on (provenance.model_summary)
        ("layout_json", pa.string()),  # parallel group sizes (provenance.parallel_layout)
        ("command_line", pa.list_(pa.string())),  # the launching argv, secrets scrubbed
    ]
)

TOPOLOGY_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("attempt", pa.int32()),
        *COORD_COLUMNS,
        ("layers", pa.list_(pa.int32())),
        ("hostname", pa.string()),
    ]
)

DROPS_SCHEMA = pa.schema(KEY_COLUMNS + [("reason", pa.string()), ("dropped_at", _TS)])

REPORTS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("attempt", pa.int32()),
        ("rank", pa.int32()),
        ("sink", pa.string()),
        ("records_written", pa.int64()),
        ("bytes_written", pa.int64()),
        ("records_spooled", pa.int64()),
        ("bytes_spooled", pa.int64()),
        ("records_dropped", pa.int64()),
        ("bytes_dropped", pa.int64()),
        ("errors", pa.list_(pa.string())),
        ("closed_at", _TS),
    ]
)

# The key columns an expert_counts row keeps from its router.expert_counts record.
EXPERT_COUNT_KEYS = (
    "run_id",
    "phase",
    "iteration",
    "attempt",
    "microbatch",
    "invocation",
    "layer",
    "rank",
    "dp",
    "token_start",
    "token_end",
    "token_total",
)
EXPERT_COUNTS_SCHEMA = pa.schema(
    [
        *(c for c in KEY_COLUMNS if c[0] in EXPERT_COUNT_KEYS),
        ("expert", pa.int32()),
        ("tokens_pre", pa.int64()),
        ("tokens_post", pa.int64()),
    ]
)

SEGMENTS_SCHEMA = pa.schema(
    [
        ("segment_id", pa.string()),
        ("path", pa.string()),
        ("kind", pa.string()),
        ("rank", pa.int32()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("status", pa.string()),  # ok | partial (some records quarantined) | corrupt (none loaded)
        ("error", pa.string()),
        ("ingested_at", _TS),
    ]
)

# Records (``row`` >= 0: its index in the segment) or parts of segments (``row`` -1) that failed
# verification at ingest; ``key_json`` holds what of the key could still be trusted.
QUARANTINE_SCHEMA = pa.schema(
    [
        ("segment_id", pa.string()),
        ("path", pa.string()),
        ("rank", pa.int32()),
        ("row", pa.int64()),
        ("run_id", pa.string()),
        ("phase", pa.string()),
        ("iteration", pa.int64()),
        ("attempt", pa.int32()),
        ("key_json", pa.string()),
        ("reason", pa.string()),
        ("quarantined_at", _TS),
    ]
)

# Kinds of spool segments and the table each one feeds.
KIND_SCHEMAS: dict[str, pa.Schema] = {
    "tensors": TENSOR_SCHEMA,
    "runs": RUNS_SCHEMA,
    "topology": TOPOLOGY_SCHEMA,
    "drops": DROPS_SCHEMA,
    "reports": REPORTS_SCHEMA,
}
TABLE_SCHEMAS: dict[str, pa.Schema] = dict(
    KIND_SCHEMAS, expert_counts=EXPERT_COUNTS_SCHEMA, segments=SEGMENTS_SCHEMA, quarantine=QUARANTINE_SCHEMA
)

# --------------------------------------------------------------------------------------------
# ClickHouse DDL
# --------------------------------------------------------------------------------------------

_LOW_CARD = {"run_id", "phase", "output", "dtype", "kind", "status", "reason", "sink", "hostname"}
_CODECS = {
    # ints that grow slowly along the sort order
    "iteration": "CODEC(Delta, ZSTD(1))",
    "token_start": "CODEC(T64, ZSTD(1))",
    "token_end": "CODEC(T64, ZSTD(1))",
    "token_total": "CODEC(T64, ZSTD(1))",
    "nbytes": "CODEC(T64, ZSTD(1))",
    "tokens_pre": "CODEC(T64, ZSTD(1))",
    "tokens_post": "CODEC(T64, ZSTD(1))",
    "config_json": "CODEC(ZSTD(3))",
}
_SMALL_INT_CODEC = "CODEC(T64, ZSTD(1))"

# The payload column's codec is a store setting (``--dmi-store-codec``), fixed when the store's tables are
# created: ZSTD(1) saves about a fifth of the disk on bf16 activations but is the slowest stage of ingest;
# LZ4 and none save nothing on bf16 and insert about 1.7x faster (docs/storage.md has the figures).
PAYLOAD_CODECS = {"lz4": "LZ4", "zstd1": "ZSTD(1)", "none": "NONE"}  # the choices of DMIConfig.store_codec
DEFAULT_PAYLOAD_CODEC = "lz4"


class PayloadCodecError(DMIError, ValueError):
    """A payload codec name that is not one of ``PAYLOAD_CODECS``."""


def check_payload_codec(name: str) -> str:
    """``name`` if it is a payload codec setting (zstd1, lz4, none), else ``PayloadCodecError``."""
    if name not in PAYLOAD_CODECS:
        raise PayloadCodecError(f"unknown store codec {name!r}: expected one of {', '.join(PAYLOAD_CODECS)}")
    return name


def payload_codec_setting(ddl_codec: str) -> str | None:
    """The setting (zstd1, lz4, none) of a payload column's codec as ClickHouse reports it
    (``system.columns.compression_codec``, e.g. ``CODEC(ZSTD(1))``); None for an empty or another one."""
    for name, codec in PAYLOAD_CODECS.items():
        if ddl_codec.replace(" ", "") == f"CODEC({codec})":
            return name
    return None


def _ch_type(name: str, t: pa.DataType) -> str:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"Array({_ch_type('', t.value_type)})"
    if pa.types.is_timestamp(t):
        return "DateTime64(3, 'UTC')"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "LowCardinality(String)" if name in _LOW_CARD else "String"
    ints = {
        pa.int8(): "Int8",
        pa.int16(): "Int16",
        pa.int32(): "Int32",
        pa.int64(): "Int64",
        pa.uint8(): "UInt8",
        pa.uint16(): "UInt16",
        pa.uint32(): "UInt32",
        pa.uint64(): "UInt64",
    }
    if t in ints:
        return ints[t]
    if pa.types.is_float64(t):
        return "Float64"
    raise InvalidArgumentError(f"no ClickHouse type for column {name}: {t}")


def _columns(schema: pa.Schema, payload_codec: str) -> str:
    cols = []
    for f in schema:
        ch = _ch_type(f.name, f.type)
        codec = f"CODEC({PAYLOAD_CODECS[payload_codec]})" if f.name == "payload" else _CODECS.get(f.name)
        if codec is None and ch in ("Int32", "Int16", "UInt32") and f.name not in ("checksum",):
            codec = _SMALL_INT_CODEC
        cols.append(f"    {f.name} {ch}" + (f" {codec}" if codec else ""))
    return ",\n".join(cols)


# ORDER BY of each table. ReplacingMergeTree collapses rows with equal sort keys, so the sort key
# must identify a row completely: re-ingesting a segment (crash between insert and bookkeeping,
# spool replay) then leaves exactly one copy under FINAL.
ORDER_BY: dict[str, tuple[str, ...]] = {
    "tensors": (
        "run_id",
        "phase",
        "output",
        "layer",
        "iteration",
        "microbatch",
        "dp",
        "invocation",
        "attempt",
        "rank",
        "shard_index",
        "token_start",
    ),
    "expert_counts": (
        "run_id",
        "phase",
        "layer",
        "iteration",
        "microbatch",
        "dp",
        "invocation",
        "attempt",
        "token_start",
        "token_end",
        "rank",
        "expert",
    ),
    "runs": ("run_id", "attempt"),
    "topology": ("run_id", "attempt", "rank"),
    "drops": (
        "run_id",
        "attempt",
        "rank",
        "phase",
        "iteration",
        "microbatch",
        "layer",
        "output",
        "invocation",
        "shard_index",
        "token_start",
    ),
    "reports": ("run_id", "attempt", "rank", "sink"),
    "segments": ("segment_id",),
    "quarantine": ("segment_id", "row", "reason"),
}

TABLES = ("tensors", "expert_counts", "runs", "topology", "drops", "reports", "segments", "quarantine")


def ddl(database: str = DEFAULT_DATABASE, payload_codec: str = DEFAULT_PAYLOAD_CODEC) -> list[str]:
    """Statements that create the database, every table and the ``*_latest`` views (idempotent: IF NOT EXISTS);
    a table created by them stores payloads with ``payload_codec`` (a key of ``PAYLOAD_CODECS``)."""
    db = check_identifier(database, "database name")
    check_payload_codec(payload_codec)
    out = [f"CREATE DATABASE IF NOT EXISTS {db}"]
    out.append(
        f"CREATE TABLE IF NOT EXISTS {db}.schema_version (\n    version UInt32,\n"
        f"    created_at DateTime64(3, 'UTC') DEFAULT now64(3)\n) ENGINE = ReplacingMergeTree ORDER BY version"
    )
    for table in TABLES:
        schema = TABLE_SCHEMAS[table]
        order = ", ".join(ORDER_BY[table])
        out.append(
            f"CREATE TABLE IF NOT EXISTS {qualified(db, table)} (\n{_columns(schema, payload_codec)}\n)"
            f" ENGINE = ReplacingMergeTree ORDER BY ({order})"
        )
    out += [_latest_view(db, view, table) for view, table in LATEST_VIEWS.items()]
    return out


# Views holding exactly what the reader sees (plain SQL's way to skip superseded attempts): each
# (run, phase, iteration) from the highest attempt that has rows for it and is not cut off by a later
# attempt resumed from an earlier checkpoint (``runs.resumed_from_iteration``). Views add no
# column and no table, so a store of this schema version gains them on open (``CREATE ... IF NOT EXISTS``).
LATEST_VIEWS = {"tensors_latest": "tensors", "expert_counts_latest": "expert_counts"}


def _latest_view(db: str, view: str, table: str) -> str:
    source = qualified(db, table)
    return (
        f"CREATE VIEW IF NOT EXISTS {qualified(db, view)} AS\n"
        f"SELECT * FROM {source} FINAL\n"
        "WHERE (run_id, phase, iteration, attempt) IN (\n"
        "    SELECT run_id, phase, iteration, max(attempt) FROM (\n"
        "        SELECT k.run_id AS run_id, k.phase AS phase, k.iteration AS iteration, k.attempt AS attempt\n"
        f"        FROM (SELECT DISTINCT run_id, phase, iteration, attempt FROM {source}) AS k\n"
        "        LEFT JOIN (\n"
        "            SELECT run_id, groupArray((attempt, resumed_from_iteration)) AS resumes\n"
        "            FROM (SELECT run_id, attempt, any(resumed_from_iteration) AS resumed_from_iteration\n"
        f"                  FROM {qualified(db, 'runs')} FINAL GROUP BY run_id, attempt)\n"
        "            GROUP BY run_id\n"
        "        ) AS c ON k.run_id = c.run_id\n"
        "        WHERE NOT arrayExists(x -> x.1 > k.attempt AND x.2 >= 0 AND k.iteration > x.2, c.resumes)\n"
        "    )\n"
        "    GROUP BY run_id, phase, iteration\n"
        ")"
    )


def version_mismatch(found: int, where: str) -> SchemaVersionError:
    """The error for a store (``where``) at another schema version, with what to do."""
    return SchemaVersionError(
        f"DMI store {where} has schema version {found}, but this megatron-dmi reads and writes schema "
        f"version {SCHEMA_VERSION}; open it with a matching megatron-dmi release or load its spool files "
        f"into a new store"
    )
