"""A local ClickHouse server for tests: ClickHouse's HTTP interface, as far as clickhouse-connect uses it, in
front of chDB (the ClickHouse engine, one process, its own store folder). No ClickHouse server can be installed
here; this one executes every statement on the real engine, so what the server path of DMI stores, reads back
and deduplicates is what ClickHouse does.

What it speaks (read off clickhouse-connect 1.x's HTTP client, ``driver/_backend/httpcommon.py`` and
``http_sync.py``):

* ``GET /ping``: ``Ok.``;
* a statement in the request body, or in the ``query`` URL parameter (then the body is an insert's data), or
  in a ``multipart/form-data`` field ``query`` (clickhouse-connect moves large bind parameters there);
* bind parameters ``param_<name>`` (URL or form), in ClickHouse's text format, bound by the engine;
* settings as URL parameters (those the engine knows; transport-only ones such as ``wait_end_of_query`` are
  ignored), applied to that request alone; ``database``;
* queries answer in the statement's trailing ``FORMAT`` (``Native`` for the client's own queries, ``Arrow`` for
  ``query_arrow``, ``JSON`` for column probes) or TabSeparated (commands);
* inserts ``INSERT INTO t (cols) FORMAT <fmt>`` followed by the data (``insert_arrow`` sends an Arrow IPC file):
  the engine reads the data itself (``FROM INFILE``);
* errors: HTTP 500 with ``X-ClickHouse-Exception-Code`` and ClickHouse's message as the body.

Faults, for tests (``POST /dmi-test/fault`` with a JSON object; ``ChdbServer.fault``):

* ``{"refuse_s": S}``: close the listening socket for S seconds (connections are refused), then listen again;
* ``{"insert": MODE, "table": T, "times": N}``: the next N inserts into table T (default ``tensors``):
  ``fail_500`` answers 500 and stores nothing; ``store_then_500`` stores the rows, then answers 500;
  ``drop_row`` stores all rows but the first and answers 200 (an insert acknowledged and partly lost);
  ``die_mid_body`` kills the server (SIGKILL) half way through receiving the data; ``die_after_store`` kills
  it after storing the rows, before answering.

``GET /dmi-test/stats`` answers the rows stored per table and the faults fired. Run it as a script (it prints
its port, then serves), or start it from a test with ``ChdbServer``:

    python tests/fault_tests/chdb_server.py --store DIR [--port N] [--lifetime S]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from email.parser import BytesParser
from email.policy import HTTP

FAULT_MODES = ("fail_500", "store_then_500", "drop_row", "die_mid_body", "die_after_store")
# URL parameters of the HTTP interface that are no engine setting
TRANSPORT_PARAMS = {"query", "database", "query_id", "session_id", "session_timeout", "session_check", "default_format"}
_INSERT = re.compile(r"\s*INSERT\s+INTO\s+(?P<table>[^\s(]+)\s*(?P<cols>\(.*?\))?\s*FORMAT\s+(?P<fmt>\w+)", re.I | re.S)
_TRAILING_FORMAT = re.compile(r"\s+FORMAT\s+(\w+)\s*;?\s*$", re.I)
_CODE = re.compile(r"Code: (\d+)\.")


class FaultError(Exception):
    """A fault the test asked for: answered as a ClickHouse error."""


class Engine:
    """The chDB store behind the server: a pool of sessions on one store folder (one per request in flight, so
    requests run in parallel as on a server), the engine's settings, the faults waiting and what was stored."""

    def __init__(self, store: str):
        from chdb import session as chs

        self._open = lambda: chs.Session(store)
        self.incoming = tempfile.mkdtemp(prefix="incoming-", dir=os.path.dirname(os.path.abspath(store)))
        self._sessions: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        first = self._open()
        rows = first.query("SELECT name, value FROM system.settings", "JSONCompact").bytes()
        self.defaults = dict(json.loads(rows)["data"])
        self.timezone = first.query("SELECT timezone()", "TabSeparated").bytes().decode().strip()
        self._sessions.put([first, {}])
        self.faults: list[dict] = []
        self.stats = {"stored_rows": {}, "faults_fired": []}
        self.refuse_s = 0.0

    def session(self):
        """A free session (a new one when every session is busy) and the settings it has changed."""
        try:
            return self._sessions.get_nowait()
        except queue.Empty:
            return [self._open(), {}]

    def release(self, held) -> None:
        self._sessions.put(held)

    def take_fault(self, table: str) -> str | None:
        """The fault mode due for an insert into ``table`` (consumed), or None."""
        with self.lock:
            for f in self.faults:
                if f["table"] == table and f["times"] > 0:
                    f["times"] -= 1
                    self.stats["faults_fired"].append(f"{f['insert']}:{table}")
                    print(f"chdb_server: fault {f['insert']} on an insert into {table}", file=sys.stderr, flush=True)
                    return f["insert"]
        return None

    def stored(self, table: str, rows: int) -> None:
        with self.lock:
            self.stats["stored_rows"][table] = self.stats["stored_rows"].get(table, 0) + rows


def _apply_settings(held, params: dict, engine: Engine) -> None:
    """This request's settings on the session, and the ones an earlier request changed back to their defaults."""
    session, changed = held
    wanted = {k: v for k, v in params.items() if k in engine.defaults and k not in TRANSPORT_PARAMS}
    for name in [n for n in changed if n not in wanted]:
        session.query(f"SET {name} = '{_quote(engine.defaults[name])}'")
        del changed[name]
    for name, value in wanted.items():
        if changed.get(name) != value:
            session.query(f"SET {name} = '{_quote(value)}'")
            changed[name] = value
    session.query(f"USE {params.get('database') or 'default'}")


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


class Handler(http.server.BaseHTTPRequestHandler):
    """One request of ClickHouse's HTTP interface (HTTP/1.0: a connection per request, so a refusal takes effect
    at once)."""

    server: http.server.ThreadingHTTPServer

    @property
    def engine(self) -> Engine:
        return self.server.engine  # type: ignore[attr-defined]

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        self._serve()

    def do_POST(self):  # noqa: N802
        self._serve()

    def _reply(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, message: str, code: int) -> None:
        self._reply(
            500, f"Code: {code}. DB::Exception: {message}\n".encode(), {"X-ClickHouse-Exception-Code": str(code)}
        )

    def _serve(self):
        url = urllib.parse.urlsplit(self.path)
        path = url.path.rstrip("/")
        if path == "/ping":
            return self._reply(200, b"Ok.\n")
        if path == "/dmi-test/fault":
            return self._fault()
        if path == "/dmi-test/stats":
            with self.engine.lock:
                return self._reply(200, json.dumps(self.engine.stats).encode())
        if path:
            return self._reply(404, b"There is no handle " + path.encode() + b"\n")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._error("this test server takes request bodies with a Content-Length only", 1001)
        if self.headers.get("Content-Encoding"):
            return self._error(f"this test server takes no Content-Encoding ({self.headers['Content-Encoding']})", 1001)
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        ctype = self.headers.get("Content-Type", "")
        if ctype.startswith("multipart/form-data"):
            params.update(_form_fields(ctype, self.rfile.read(length)))
            body, length = b"", 0
        else:
            body = None  # read below: an insert's data may be cut by a fault
        statement = params.pop("query", None)
        if statement is None:
            body = self.rfile.read(length)
            insert = _INSERT.match(body[:65536].decode("latin-1"))
            if insert and body.find(b"\n", insert.end()) >= 0:
                cut = body.index(b"\n", insert.end()) + 1
                statement, body = body[:cut].decode().strip(), body[cut:]
            else:
                statement, body = body.decode(), b""
            length = len(body)
        insert = _INSERT.fullmatch(statement.strip().rstrip(";"))
        if body is None and not insert:  # a statement in the URL, continued by the body (ClickHouse's rule)
            body = self.rfile.read(length)
            statement, body = statement + ("\n" + body.decode() if body else ""), b""
        bind = {k[len("param_") :]: v for k, v in params.items() if k.startswith("param_")}
        held = self.engine.session()
        try:
            _apply_settings(held, params, self.engine)
            if insert:
                rows = self._insert(held[0], insert, body, length)
                summary = json.dumps({"written_rows": str(rows), "written_bytes": str(length)})
                return self._reply(200, b"", self._headers(params, {"X-ClickHouse-Summary": summary}))
            fmt = params.get("default_format", "TabSeparated")
            trailing = _TRAILING_FORMAT.search(statement)
            if trailing:
                statement, fmt = statement[: trailing.start()], trailing.group(1)
            out = held[0].query(statement, fmt, params=bind or None).bytes()
            return self._reply(200, out, self._headers(params, {"X-ClickHouse-Format": fmt}))
        except FaultError as e:
            return self._error(str(e), 1002)
        except Exception as e:  # the engine refused the statement: answered as ClickHouse answers
            text = str(e)
            code = _CODE.search(text)
            return self._error(text.split("DB::Exception: ", 1)[-1], int(code.group(1)) if code else 1000)
        finally:
            self.engine.release(held)

    def _headers(self, params: dict, more: dict) -> dict:
        return {
            "X-ClickHouse-Query-Id": params.get("query_id", ""),
            "X-ClickHouse-Timezone": self.engine.timezone,
            **more,
        }

    def _insert(self, session, insert: re.Match, body: bytes | None, length: int) -> int:
        """Store an insert's data through the engine (its own format reader), with the fault due, if any;
        returns the rows stored."""
        table = insert.group("table").replace("`", "").split(".")[-1]
        fault = self.engine.take_fault(table)
        if body is None:  # the data is still on the wire
            if fault == "die_mid_body":
                self.rfile.read(length // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            body = self.rfile.read(length)
        if fault == "fail_500":
            raise FaultError(f"test fault: the insert into {table} failed; nothing was stored")
        path = os.path.join(self.engine.incoming, f"{uuid.uuid4().hex}.{insert.group('fmt').lower()}")
        with open(path, "wb") as f:
            f.write(body)
        try:
            fmt, target, cols = insert.group("fmt"), insert.group("table"), insert.group("cols") or ""
            if fault == "drop_row":
                sql = (
                    f"INSERT INTO {target} {cols} SELECT * FROM file('{path}', {fmt}) WHERE rowNumberInAllBlocks() > 0"
                )
            else:
                sql = f"INSERT INTO {target} {cols} FROM INFILE '{path}' FORMAT {fmt}"
            rows = session.query(sql).rows_written()
        finally:
            os.unlink(path)
        self.engine.stored(table, rows)
        if fault == "die_after_store":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "store_then_500":
            raise FaultError(f"test fault: the insert into {table} stored its {rows} rows, then failed")
        return rows

    def _fault(self):
        ask = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with self.engine.lock:
            if "insert" in ask:
                if ask["insert"] not in FAULT_MODES:
                    return self._reply(400, f"unknown fault {ask['insert']!r}; one of {FAULT_MODES}\n".encode())
                self.engine.faults.append(
                    {"insert": ask["insert"], "table": ask.get("table", "tensors"), "times": int(ask.get("times", 1))}
                )
            refuse = float(ask.get("refuse_s", 0))
        self._reply(200, b"ok\n")
        if refuse:
            self.engine.refuse_s = refuse
            threading.Thread(target=self.server.shutdown, daemon=True).start()


def _form_fields(ctype: str, body: bytes) -> dict:
    msg = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {ctype}\r\n\r\n".encode() + body)
    out = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        out[name] = part.get_payload(decode=True).decode()
    return out


def serve(store: str, port: int, lifetime_s: float) -> None:
    """Serve the store on ``port`` (0: a free one), printing the port; a refusal fault closes the listening socket
    for a while and listens again on the same port. Ends after ``lifetime_s`` (a forgotten server goes away)."""
    engine = Engine(store)
    threading.Timer(lifetime_s, os._exit, (0,)).start()
    announced = False
    while True:
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        httpd.daemon_threads = True
        httpd.engine = engine  # type: ignore[attr-defined]
        port = httpd.server_address[1]
        if not announced:
            print(port, flush=True)
            announced = True
        httpd.serve_forever(poll_interval=0.05)
        httpd.server_close()
        time.sleep(engine.refuse_s)
        engine.refuse_s = 0.0


class ChdbServer:
    """The server as a process of its own, for a test: ``url``, ``fault(...)``, ``stats()``, ``kill()`` (SIGKILL)
    and ``start()`` again on the same port and store."""

    def __init__(self, store: str, port: int = 0):
        self.store = store
        self.port = port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ChdbServer:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--store", self.store, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError(f"the test server did not start (exit status {self.proc.wait()})")
        self.port = int(line)
        return self

    def _call(self, path: str, ask: dict | None = None) -> bytes:
        data = json.dumps(ask).encode() if ask is not None else None
        with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data), timeout=30) as r:
            return r.read()

    def fault(self, **ask) -> None:
        """Ask for a fault (see the module's docstring)."""
        self._call("/dmi-test/fault", ask)

    def stats(self) -> dict:
        """Rows stored per table since this process started, and the faults fired."""
        return json.loads(self._call("/dmi-test/stats"))

    def kill(self) -> None:
        """kill -9, and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def __enter__(self) -> ChdbServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.kill()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="the chDB store folder the server owns")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    p.add_argument("--lifetime", type=float, default=1800, help="seconds before the server ends by itself")
    a = p.parse_args()
    serve(a.store, a.port, a.lifetime)
