"""Waiting for a started tritonserver: ready means the model answers ready and /metrics can be scraped.

Triton starts its metrics endpoint after HTTP (tens of ms later on a loaded host). A test that scraped metrics
right after the model turned ready once met a refused connection; here two stand-in endpoints open in that order.
"""

from __future__ import annotations

import http.server
import subprocess
import threading
import urllib.request

from pagedllm.net import free_ports
from pagedllm.serving import launcher


class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def serve(port: int) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_ready_waits_for_the_metrics_endpoint_opened_after_http():
    http_port, metrics_port = free_ports(2)
    alive = subprocess.Popen(["sleep", "60"])  # stands in for tritonserver's process
    servers = [serve(http_port)]
    late = threading.Timer(0.5, lambda: servers.append(serve(metrics_port)))
    late.start()
    try:
        launcher.wait_ready(http_port, alive, timeout=10, model="pagedllm", metrics_port=metrics_port)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
            assert r.status == 200
    finally:
        late.join()
        for s in servers:
            s.shutdown()
            s.server_close()
        alive.kill()
        alive.wait()
