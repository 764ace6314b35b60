"""The metrics endpoint: `/metrics` over HTTP (or HTTPS) on a port of its own, answered on threads of its own.

Whatever connects, it bounds what the process spends on it: connections (MAX_CONNECTIONS, a thread each),
how long one may stay silent (CONNECTION_TIMEOUT_S), and how often the registry is rendered (`Renders`).
A render reads every collector under the GIL the event loop needs (about 1.9 ms on 2 cores): four
scrapers looping flat out took W1 at concurrency 32 from 1,251 to 273 req/s before renders were bounded
(BENCHMARKS.md, sixtieth pass).
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)
# How long the metrics endpoint waits on a connection that sends (or takes) nothing, handshake included: a
# scrape takes milliseconds, and Prometheus' own scrape timeout is 10 s by default.
CONNECTION_TIMEOUT_S = 15.0
# How many connections the metrics endpoint serves at once, a thread each: scrapers are a handful (an HA
# Prometheus pair, a debugging curl); one past this is closed at once rather than given a thread.
MAX_CONNECTIONS = 64
# Renders start at least this far apart, and further for a costly one: at most RENDER_SHARE of the
# time is spent rendering. Prometheus scrapes every 15 s or so; a scrape that comes sooner waits its turn.
MIN_RENDER_INTERVAL_S = 0.05
RENDER_SHARE = 0.05

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def serve(
    registry: CollectorRegistry,
    host: str,
    port: int,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
) -> MetricsHTTPServer:
    """Starts the endpoint on a thread of its own: `/metrics` only (anything else is 404), over TLS
    when given a certificate and key (and, with a client CA, only for clients it signed)."""
    renders = Renders(make_wsgi_app(registry))

    def only_metrics(environ, start_response):
        if environ.get("PATH_INFO", "") not in ("/metrics", "/metrics/"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"attnserve answers /metrics only\n"]
        return renders(environ, start_response)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("Server", (MetricsHTTPServer,), {"address_family": family})
    httpd = make_server(host, port, only_metrics, server_class, handler_class=_QuietHandler)
    if tls_cert and tls_key:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls_cert, tls_key)
        if tls_client_ca:
            context.load_verify_locations(tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        httpd.tls = context
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd


@dataclass(frozen=True)
class _Render:
    variant: tuple[str, str, str]  # what the answer depends on besides the registry (Renders.variant)
    started: float
    answer: tuple[str, list[tuple[str, str]], bytes]  # status, headers, body


class Renders:
    """prometheus_client's WSGI app behind a turnstile: one render at a time, each starting at least
    `min_interval_s` (or `took / share`) after the one before, so a flood of scrapes costs the process a
    bounded share of its GIL. A scrape is never answered from an older render: it waits for one that
    began after it arrived, and the scrapes waiting for the same variant share it. So a scrape still shows
    everything done before it was sent, and scrapers that come faster than the interval are slowed to it."""

    min_interval_s = MIN_RENDER_INTERVAL_S
    share = RENDER_SHARE

    def __init__(self, app: WsgiApp) -> None:
        self._app = app
        self._turn = threading.Condition()
        self._rendering = False
        self._next_start = 0.0  # time.monotonic() before which no render starts
        self._last: _Render | None = None

    @staticmethod
    def variant(environ: dict[str, Any]) -> tuple[str, str, str]:
        """The request's parts prometheus_client's answer depends on: the format (Accept), gzip or not
        (Accept-Encoding), and the families asked for (the query string's name[])."""
        return environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", ""), environ.get("QUERY_STRING", "")

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "GET":  # OPTIONS, or a 405: nothing rendered
            return self._app(environ, start_response)
        status, headers, body = self._answer(environ)
        start_response(status, headers)
        return [body]

    def _answer(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        variant, arrived = self.variant(environ), time.monotonic()
        with self._turn:
            while True:
                last = self._last
                if last is not None and last.variant == variant and last.started >= arrived:
                    return last.answer
                if self._rendering:
                    self._turn.wait()
                    continue
                wait = self._next_start - time.monotonic()
                if wait <= 0:
                    break
                self._turn.wait(wait)
            self._rendering = True
        started, render = time.monotonic(), None
        try:
            answer = self._call(environ)
            render = _Render(variant, started, answer)
            return answer
        finally:
            took = time.monotonic() - started
            with self._turn:
                self._rendering = False
                self._next_start = started + max(self.min_interval_s, took / self.share)
                if render is not None:
                    self._last = render
                self._turn.notify_all()

    def _call(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        started: list[Any] = []
        body = b"".join(self._app(environ, lambda status, headers, exc_info=None: started.extend((status, headers))))
        return started[0], started[1], body


class MetricsHTTPServer(ThreadingWSGIServer):
    """The metrics endpoint's HTTP server: a thread per connection, never holding the process at exit, no
    connection held longer than CONNECTION_TIMEOUT_S without a byte either way, and at most MAX_CONNECTIONS
    at once (so at most that many threads, whatever connects).

    With TLS each connection shakes hands on its own thread. A listening socket wrapped for TLS shakes
    hands inside accept(), on the one thread that accepts: a client that connected and sent nothing held
    every scrape after it until it left (measured: each timed out)."""

    tls: ssl.SSLContext | None = None
    connection_timeout_s = CONNECTION_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    # socketserver listens with a backlog of 5: a sixth connection made while the accepting thread was
    # starting a handler's thread was dropped and its client retried a second later (measured).
    request_queue_size = socket.SOMAXCONN

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("metrics endpoint: %d connections open; one from %s closed", self.max_connections,
                      client_address[0])  # fmt: skip
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (none left to the process): the slot is not taken
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.connection_timeout_s)  # every read and write, the handshake's too
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        with self.tls.wrap_socket(request, server_side=True) as connection:  # the handshake, here
            super().finish_request(connection, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (a handshake refused or timed out, a peer that reset or fell silent) is
        the client's affair: one line at DEBUG, not socketserver's traceback on stderr."""
        log.debug("metrics endpoint: a connection from %s ended: %r", client_address[0], sys.exc_info()[1])


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass
