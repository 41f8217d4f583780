"""Serve a stand-in HTTP server on a free local port: print the port on stdout (the test reads it
from there), then serve until shut down or until ``lifetime_s`` has passed."""

import http.server
import threading


def serve(handler: type[http.server.BaseHTTPRequestHandler], lifetime_s: float) -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    print(srv.server_address[1], flush=True)
    timer = threading.Timer(lifetime_s, srv.shutdown)
    timer.daemon = True
    timer.start()
    srv.serve_forever()
    srv.server_close()
