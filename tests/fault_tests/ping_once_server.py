"""A stand-in that answers exactly one ``GET /ping`` like a ClickHouse server (``Ok.``) and then
goes away: the port closes, as when a server dies right after a training passed its start-up
check. Prints the port on stdout, exits after the ping (or after 120 s).

    python tests/fault_tests/ping_once_server.py
"""

import http.server
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_stub import serve  # noqa: E402


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        ok = self.path.rstrip("/").endswith("/ping")
        body = b"Ok.\n" if ok else b"not a ClickHouse server\n"
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if ok:
            threading.Thread(target=self.server.shutdown, daemon=True).start()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    serve(Handler, lifetime_s=120)
