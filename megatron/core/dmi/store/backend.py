"""Database backends: the embedded chDB store and a ClickHouse server, behind one small interface.

Everything above this module (sinks, ingester, reader) speaks the same SQL (rendered by
``schema``) and moves data as Arrow tables, so the embedded and the server paths share all of it.
Values always travel as bound parameters (``{name:Type}``); only validated identifiers are
spliced into SQL text.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatron.core.dmi.errors import DMIError, InvalidArgumentError
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store_address import check_database, check_identifier, parse_server_url, redact, resolve_password

log = logging.getLogger(__name__)


class StoreBusyError(DMIError, RuntimeError):
    """Another process holds the embedded store (chDB allows one process per store path)."""


class BackendError(DMIError, RuntimeError):
    """A ClickHouse server could not be reached or refused a statement (the message has no secrets)."""


def normalize_result(table: pa.Table) -> pa.Table:
    """Make result columns predictable: ``payload`` is binary, every other text column a string."""
    cols, fields = [], []
    for f, col in zip(table.schema, table.columns):
        t = f.type
        if f.name == "payload":
            if pa.types.is_string(t) or pa.types.is_binary(t):
                col = pa.chunked_array([c.view(pa.binary()) for c in col.chunks], type=pa.binary())
            elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
                col = pa.chunked_array([c.view(pa.large_binary()) for c in col.chunks], type=pa.large_binary())
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
            col = col.cast(pa.string())
        elif pa.types.is_dictionary(t):
            col = col.cast(t.value_type)
            if pa.types.is_binary(col.type):
                col = col.cast(pa.string())
        cols.append(col)
        fields.append(pa.field(f.name, col.type))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


class Backend(ABC):
    """A store's SQL connection: statements, Arrow queries and Arrow inserts, embedded or on a server."""

    database: str
    description: str
    payload_codec: str | None = None  # the store's payload codec, known once ensure_schema ran
    insert_streams: int = 1  # pipelines one large insert runs side by side (the embedded store's ``use_threads``)

    @abstractmethod
    def command(self, sql: str, params: dict[str, Any] | None = None) -> None:
        """Run a statement that returns nothing; ``params`` bind its ``{name:Type}`` placeholders."""

    @abstractmethod
    def query_arrow(self, sql: str, params: dict[str, Any] | None = None) -> pa.Table:
        """Run a query, ``params`` bound, and return its result as an Arrow table."""

    @abstractmethod
    def insert_arrow(self, table: str, data: pa.Table) -> None:
        """Insert the rows of ``data`` into ``table`` of the store's database."""

    def close(self) -> None:
        """Release the connection; this default has nothing to release."""
        pass

    def free_bytes(self) -> int | None:
        """Free space on the store's file system (None: not known here, e.g. a server)."""
        return None

    def use_threads(self, threads: int) -> int:
        """Let a load use ``threads`` threads; returns how many batches ``ingest_spool`` should insert at once
        (``streams``). A server takes that many parallel inserts, each its own request."""
        return threads

    def t(self, table: str) -> str:
        """Qualified, validated table name."""
        return S.qualified(self.database, table)

    def ensure_schema(self, payload_codec: str | None = None) -> None:
        """Create missing tables; refuse a store of another schema version. A new store's payloads get
        ``payload_codec`` (``schema.PAYLOAD_CODECS``; None: the default); an existing store keeps the codec it
        was created with (a warning when another one was asked for). ``self.payload_codec`` is then the store's."""
        db = check_identifier(self.database, "database name")
        if payload_codec is not None:
            S.check_payload_codec(payload_codec)
        exists = (
            self.query_arrow(
                "SELECT count() AS n FROM system.tables WHERE database = {db:String} AND name = 'schema_version'",
                {"db": db},
            )
            .column("n")[0]
            .as_py()
        )
        if exists:
            self._check_version()
        kept = self._stored_payload_codec()
        if kept is not None and payload_codec is not None and kept != payload_codec:
            log.warning(
                "DMI store %s keeps the payload codec %s it was created with; the store codec %s applies to new "
                "stores only",
                self.description,
                kept,
                payload_codec,
            )
        self.payload_codec = kept or payload_codec or S.DEFAULT_PAYLOAD_CODEC
        # Only the tensors table has a payload column: a store whose codec is no setting has that table already.
        ddl_codec = self.payload_codec if self.payload_codec in S.PAYLOAD_CODECS else S.DEFAULT_PAYLOAD_CODEC
        for stmt in S.ddl(db, ddl_codec):
            self.command(stmt)
        if not exists:
            self.command(f"INSERT INTO {db}.schema_version (version) VALUES ({{v:UInt32}})", {"v": S.SCHEMA_VERSION})
        self._check_version()

    def _stored_payload_codec(self) -> str | None:
        """The payload codec of the store's ``tensors`` table (None: no such table yet). The table's own
        definition is the record: ClickHouse keeps each column's codec (``system.columns``)."""
        got = self.query_arrow(
            "SELECT compression_codec FROM system.columns WHERE database = {db:String} AND table = 'tensors' "
            "AND name = 'payload'",
            {"db": self.database},
        )
        if got.num_rows == 0:
            return None
        codec = got.column("compression_codec")[0].as_py()
        # A codec outside the settings (a table made by hand) is kept, named as ClickHouse does.
        return S.payload_codec_setting(codec) or codec or "the server's default"

    def _check_version(self) -> None:
        got = (
            self.query_arrow(f"SELECT DISTINCT version FROM {self.database}.schema_version")
            .column("version")
            .to_pylist()
        )
        bad = [v for v in got if v != S.SCHEMA_VERSION]
        if bad:
            raise S.version_mismatch(int(bad[0]), self.description)


# ------------------------------------------------------------------------------------------------
# Embedded chDB
# ------------------------------------------------------------------------------------------------


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def _param_elem(v: Any) -> str:
    if isinstance(v, str):
        return "'" + _esc(v).replace("'", "\\'") + "'"
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_param_elem(x) for x in v) + "]"
    raise InvalidArgumentError(
        f"unsupported query parameter value {type(v).__name__} (expected str, bool, int, float or a list of them)"
    )


def chdb_params(params: dict[str, Any] | None) -> dict[str, str] | None:
    """Parameter values as chDB takes them: text in ClickHouse's escaped format, encoded exactly."""
    if not params:
        return None
    out = {}
    for k, v in params.items():
        if isinstance(v, str):
            out[k] = _esc(v)
        elif v is None:
            out[k] = "\\N"
        else:
            out[k] = _param_elem(v)
    return out


# The smallest insert stream: each stream writes a part of its own, and small parts are soon merged again
# (on the 2-core VM, two streams per 256 MiB batch cost about the CPU per GiB of one with merges stopped,
# and up to 1.8x more with them running: docs/benchmarks.md). A batch under twice this is one stream.
MIN_STREAM_BYTES = 64 << 20


def _row_bytes(batch: pa.RecordBatch) -> np.ndarray:
    """Bytes of each row's variable-width values (what dominates a row: the payload)."""
    sizes = np.zeros(batch.num_rows, dtype=np.int64)
    for col in batch.columns:
        t = col.type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
            sizes += pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)
    return sizes


def insert_streams(data: pa.Table, streams: int) -> tuple[pa.Table, dict[str, int]]:
    """``data`` cut, without copying, into record batches for an ``INSERT ... SELECT FROM Python()`` that runs
    up to ``streams`` pipelines side by side, and the settings that make it do so.

    chDB's ``Python()`` source hands each of its ``max_threads`` streams whole record batches and converts them
    without the GIL; ClickHouse then squashes what the streams produce into blocks of
    ``min_insert_block_size_bytes`` (256 MiB by default: a whole batch, copied into one block, one part, one
    thread that sorts, compresses and writes it). So: record batches of about ``data.nbytes / streams`` each
    (a larger one is cut at row boundaries by its rows' bytes), squashing only of blocks under a quarter of
    that (the record blocks of a raw segment pass as they are), and as many insert threads as streams; each
    block the sink gets is a part of its own. Always ``optimize_on_insert = 0``: the ReplacingMergeTree tables
    do not deduplicate each inserted block (a pass over its payloads, 10-20 % of the insert's CPU); readers
    read with FINAL or DISTINCT, and merges deduplicate as before."""
    settings = {"optimize_on_insert": 0}
    n = max(1, min(streams, data.nbytes // MIN_STREAM_BYTES))
    if n == 1:
        return data, settings
    target = -(-data.nbytes // n)
    pieces = []
    for batch in data.to_batches():
        k = round(batch.nbytes / target)  # pieces of 0.75 to 1.5 targets: none is squashed with another
        if k <= 1:
            pieces.append(batch)
            continue
        ends = np.cumsum(_row_bytes(batch) + 1)  # + 1: rows of no variable-width value are cut by count
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, k) / k, side="right")
        bounds = [0, *sorted(set(cuts.tolist()) - {0, batch.num_rows}), batch.num_rows]
        pieces += [batch.slice(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]
    settings.update(
        max_threads=n, max_insert_threads=n, min_insert_block_size_rows=0, min_insert_block_size_bytes=target // 4
    )
    return pa.Table.from_batches(pieces, schema=data.schema), settings


def take_pid_lock(
    path: str,
    busy: Callable[[str], str],
    *,
    holder: str | None = None,
    error: type[DMIError] = StoreBusyError,
    unknown: str = "?",
) -> int:
    """Hold the ``flock`` of the file at ``path`` for this process and write ``holder`` there (by default
    this process's pid); its descriptor. ``error(busy(text))`` when another process holds it, ``text``
    being what that process wrote (``unknown`` while it has written nothing yet)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip() or unknown
        os.close(fd)
        raise error(busy(text)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid() if holder is None else holder}\n".encode(), 0)
    return fd


_open_lock = threading.Lock()
_open_session: dict[str, Any] = {}  # realpath -> [session, refcount, lockfd]


class ChdbBackend(Backend):
    """An embedded chDB store at ``path``. One process per path (a lock file guards it) and one
    path per process (a chDB limit); opening the same path twice in a process shares the session."""

    def __init__(self, path: str, database: str = S.DEFAULT_DATABASE):
        """Open the chDB store at ``path`` (or share this process's open session of it), taking its lock file;
        ``StoreBusyError`` when this process has another store open or another process holds this one."""
        self.database = check_database(database)
        self.path = os.path.realpath(path)
        self.description = f"at {path}"
        with _open_lock:
            other = [p for p in _open_session if p != self.path]
            if other:
                raise StoreBusyError(
                    f"this process already has the chDB store {other[0]} open; chDB holds one store per "
                    f"process, so open {self.path} from another process"
                )
            entry = _open_session.get(self.path)
            if entry is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                lockfd = take_pid_lock(
                    self.path + ".lock",
                    lambda holder: (
                        f"DMI store {self.path} is held by another process (pid {holder}; e.g. a running "
                        f"training's ingester or a `load`). chDB lets one process write a store: load after "
                        f"it finishes; to read, open_store and the CLI take a snapshot and need no lock"
                    ),
                )
                try:
                    from chdb import session as chs

                    sess = chs.Session(self.path)
                except BaseException:  # release the store's lock, then re-raise whatever it was
                    fcntl.flock(lockfd, fcntl.LOCK_UN)
                    os.close(lockfd)
                    raise
                entry = _open_session[self.path] = [sess, 0, lockfd]
            entry[1] += 1
            self._session = entry[0]
        self._closed = False
        self._lock = threading.Lock()  # one statement at a time (streaming inserts block the session)

    def use_threads(self, threads: int) -> int:
        """Run every query on at most ``threads`` chDB threads and insert a large batch as that many streams
        (``insert_streams``); the session runs one statement at a time, so ``ingest_spool`` inserts one batch at once."""
        self.command(f"SET max_threads = {int(threads)}")
        self.command(f"SET max_insert_threads = {int(threads)}")
        self.insert_streams = int(threads)
        return 1

    def command(self, sql, params=None):
        """Run a statement on the chDB session, one statement at a time."""
        with self._lock:
            self._session.query(sql, "CSV", params=chdb_params(params))

    def query_arrow(self, sql, params=None):
        """Run a query on the chDB session and return its normalized Arrow result."""
        with self._lock:
            res = self._session.query(sql, "ArrowTable", params=chdb_params(params))
        return normalize_result(res)

    def insert_arrow(self, table, data):
        """Insert ``data`` into ``table``, read in place by chDB in up to ``insert_streams`` parallel streams
        (``insert_streams()``; nothing to do for no rows)."""
        if data.num_rows == 0:
            return
        cols = ", ".join(check_identifier(c, "column name") for c in data.schema.names)
        # chDB's Python() table function reads the Arrow table in place, found by its name in this
        # frame: no IPC copy (about twice as fast as a streamed insert of the same 200 MB here, and half
        # the CPU of ClickHouse's own file() reader of the same batch written as Arrow files), and it
        # exists in chdb-core-lite, the engine-only package that has no send_insert.
        arrow_rows, settings = insert_streams(data, self.insert_streams)  # noqa: F841 (read by name below)
        with_settings = ", ".join(f"{k} = {int(v)}" for k, v in settings.items())
        with self._lock:
            self._session.query(
                f"INSERT INTO {self.t(table)} ({cols}) SELECT {cols} FROM Python(arrow_rows) SETTINGS {with_settings}"
            )

    def free_bytes(self) -> int | None:
        """Free space on the file system that holds the store."""
        return shutil.disk_usage(self.path).free

    def close(self):
        """Drop this backend's share of the chDB session; the last one closes the session and releases the lock file.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _open_lock:
            entry = _open_session.get(self.path)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _open_session[self.path]
                try:
                    entry[0].close()
                finally:
                    fcntl.flock(entry[2], fcntl.LOCK_UN)
                    os.close(entry[2])


# ------------------------------------------------------------------------------------------------
# ClickHouse server (clickhouse-connect)
# ------------------------------------------------------------------------------------------------


# The operating system's reason inside the driver's connection error ("[Errno 111] Connection refused"),
# which the driver wraps in its pool, query id and URL.
_OS_REASON = re.compile(r"\[Errno -?\d+\] [^\"')(]+")


class ServerBackend(Backend):
    """A ClickHouse server reached over HTTP(S), with the password from the environment or a file.

    Safe to call from several threads at once: each call takes a client of its own from a small pool (a
    clickhouse-connect client runs one request at a time), so concurrent inserts are concurrent HTTP requests,
    independent on the server (the ingester's insert streams)."""

    def __init__(
        self,
        url: str,
        database: str = S.DEFAULT_DATABASE,
        password: str | None = None,
        connect_timeout: float = 3.0,
        send_receive_timeout: float = 60.0,
    ):
        """Set up clients for the server at ``url``, connected on first use; the password is ``password``, or
        ``resolve_password()``'s when None."""
        self.database = check_database(database)
        self._kw = parse_server_url(url)
        self.description = f"at {self._kw['host']}:{self._kw['port']}"
        self._password = password if password is not None else resolve_password()
        self._connect_timeout = connect_timeout
        self._send_receive_timeout = send_receive_timeout
        self._lock = threading.Lock()
        self._idle: list = []  # connected clients no call is using

    def _take(self):
        """A connected client for one call: an idle one, or a new connection."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        import clickhouse_connect

        try:
            return clickhouse_connect.get_client(
                **self._kw,
                password=self._password,
                connect_timeout=self._connect_timeout,
                send_receive_timeout=self._send_receive_timeout,
                settings={"output_format_arrow_string_as_string": 0},
                # No LZ4 on the wire: record payloads (bf16, fp32 activations) do not shrink, and compressing an
                # Arrow insert cost the ingester 1.15 CPU-s/GiB on the 2-core VM (0.17 without) for a 1.00 ratio.
                compress=False,
            )
        except Exception as e:  # never let the password leak through an exception text
            reason = _OS_REASON.search(str(e))
            raise BackendError(
                f"cannot connect to ClickHouse {self.description}: "
                + (
                    f"{reason.group(0).strip()}; is the server running, and are the URL's host and port right?"
                    if reason
                    else self.redact(str(e))
                )
            ) from None

    def _wrap(self, fn):
        client = self._take()
        try:
            result = fn(client)
        except Exception as e:  # last resort: any client error leaves as BackendError, its text redacted
            _close_quietly(client)  # a new connection next time
            raise BackendError(f"ClickHouse {self.description}: {type(e).__name__}: {self.redact(str(e))}") from None
        with self._lock:
            self._idle.append(client)
        return result

    def redact(self, text: str) -> str:
        """``text`` with this server's password, credentials and foreign response bodies removed (see ``redact``)."""
        return redact(text, self._password, self._kw["username"])

    def ping(self) -> bool:
        """Whether the server answers a ping (False when it cannot be reached)."""
        try:
            return bool(self._wrap(lambda c: c.ping()))
        except BackendError:
            return False

    def command(self, sql, params=None):
        """Run a statement on the server (a failure raises ``BackendError``, secrets redacted)."""
        self._wrap(lambda c: c.command(sql, parameters=params or None))

    def query_arrow(self, sql, params=None):
        """Run a query on the server and return its normalized Arrow result."""
        return normalize_result(self._wrap(lambda c: c.query_arrow(sql, parameters=params or None)))

    def insert_arrow(self, table, data):
        """Insert ``data`` into ``table`` of the server's database (nothing to do for no rows)."""
        if data.num_rows == 0:
            return
        check_identifier(table, "table name")
        self._wrap(lambda c: c.insert_arrow(table, data, database=self.database))

    def close(self):
        """Close the connected clients no call is using; the next call connects again."""
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            _close_quietly(client)


def _close_quietly(client) -> None:
    try:
        client.close()
    except Exception:  # last resort: the client is dropped either way, and closing runs on error paths where a
        pass  # second error would hide the first
