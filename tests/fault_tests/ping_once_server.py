"""A stand-in that answers exactly one ``GET /ping`` like a ClickHouse server (``Ok.``) and then
goes away: the port closes, as when a server dies right after a training passed its start-up
check. Prints the port on stdout, exits after the ping (or after 120 s).

    python tests/fault_tests/ping_once_server.py
"""

import http.server
import sys
import threading


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
    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    print(srv.server_address[1], flush=True)
    timer = threading.Timer(120, srv.shutdown)
    timer.daemon = True
    timer.start()
    srv.serve_forever()
    srv.server_close()
    sys.exit(0)
