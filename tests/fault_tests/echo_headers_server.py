"""A stand-in for a proxy in front of ClickHouse that answers ``/ping`` with ``Ok.`` (so a training
passes its start-up check) and every other request with HTTP 500 whose body echoes the request's
headers, ``Authorization: Basic base64(user:password)`` included. With ``--clickhouse-code`` the
error also carries ClickHouse's exception-code header, so clients treat the body as a ClickHouse
error message. Prints the port on stdout; serves until killed (or 300 s).

    python tests/fault_tests/echo_headers_server.py [--clickhouse-code]
"""

import http.server
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_stub import serve  # noqa: E402

CLICKHOUSE_CODE = "--clickhouse-code" in sys.argv


class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        if self.path.split("?")[0].rstrip("/").endswith("/ping"):
            body, status = b"Ok.\n", 200
        else:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = (
                "Code: 516. DB::Exception: proxy refused the request; request headers were:\n"
                + "".join(f"{k}: {v}\n" for k, v in self.headers.items())
            ).encode()
            status = 500
        self.send_response(status)
        if status != 200 and CLICKHOUSE_CODE:
            self.send_header("X-ClickHouse-Exception-Code", "516")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    serve(Handler, lifetime_s=300)
