"""A fault-injecting S3 endpoint on loopback: an HTTP proxy in front of a real S3-compatible
server (``object_store.start_moto``) that answers some requests with S3's own ``503 SlowDown``
or delays them, as a throttled or overloaded store does.

The chaos benchmark (``benchmarks/chaos.py``) points the sources' and the snapshots'
``storage_options`` at it and turns faults on and off while a run goes on::

    proxy = FaultyStore(moto_endpoint, seed=7)
    proxy.start()                                   # proxy.endpoint: http://127.0.0.1:<port>
    proxy.set(error_rate=0.3, bucket="corpus")      # 30 % of the corpus's requests get a 503
    proxy.set(latency_s=0.5)                        # every request waits half a second
    proxy.set()                                     # healed

Which request fails is drawn from a generator seeded with ``seed`` (the same seed, the same
draws in the order requests arrive). ``counts`` says how many requests were forwarded, failed,
delayed. The clients retry 503s as they would against AWS (botocore's retry policy): a fault
reaches the service only when every retry of a request failed.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate. (injected by overlord_dask.testing.faulty_store)</Message></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "trailer"}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-request (a killed service) is no error of the store's."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class FaultyStore:
    """The proxy: ``start()`` it, read ``endpoint``, ``set()`` faults, ``stop()`` it."""

    def __init__(self, upstream: str, seed: int = 0, host: str = "127.0.0.1"):
        self.host = host  # the address it listens on (loopback; a test's bridge address for a network namespace)
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.error_rate, self.latency_s, self.bucket = 0.0, 0.0, None
        self.counts = {"forwarded": 0, "failed": 0, "delayed": 0}
        self.server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.server.server_address[1]}"

    def set(self, error_rate: float = 0.0, latency_s: float = 0.0, bucket: str | None = None) -> None:
        """Answer ``error_rate`` of the requests (to ``bucket`` only, if given) with a 503 and
        delay each by ``latency_s``; no argument: healed."""
        if not 0.0 <= error_rate <= 1.0 or latency_s < 0:
            raise ValueError(f"error_rate must be in [0, 1] and latency_s >= 0, got {error_rate}, {latency_s}")
        with self.lock:
            self.error_rate, self.latency_s, self.bucket = float(error_rate), float(latency_s), bucket

    def fault(self, path: str) -> tuple[bool, float]:
        """(answer 503?, seconds to wait) for a request to ``path``."""
        with self.lock:
            if self.bucket is not None and path.lstrip("/").split("/", 1)[0].split("?")[0] != self.bucket:
                return False, 0.0
            fail = self.error_rate > 0 and self.rng.random() < self.error_rate
            self.counts["failed" if fail else "forwarded"] += 1
            self.counts["delayed"] += self.latency_s > 0
            return fail, self.latency_s

    def start(self) -> FaultyStore:
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: the benchmark reports counts
                pass

            def _proxy(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                fail, wait = store.fault(self.path)
                if wait:
                    time.sleep(wait)
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                conn = http.client.HTTPConnection(*store.upstream, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                head = self.command == "HEAD"  # (its Content-Length is the object's: passed on)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _proxy

        self.server = _Server((self.host, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="faulty-store", daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
