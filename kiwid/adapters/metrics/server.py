"""The ``/metrics`` endpoint: the listen address, and an HTTP server on a background thread.

A scrape answers the `Exposition` of one snapshot, then ``prometheus_client``'s
``process_*`` metrics of this process.

The snapshot callable runs on the HTTP server's threads, possibly several at
once: it must be thread-safe and cheap, e.g. return a dict the daemon's loop
rebuilt and swapped in whole (never one the loop is still mutating).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from socketserver import TCPServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

from kiwid.adapters.metrics.exposition import Exposition

logger = logging.getLogger("kiwid.metrics")

Snapshot = Callable[[], Mapping[str, Any]]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsError(Exception):
    """The metrics endpoint cannot start: a malformed address, or binding it failed."""


def parse_listen(listen: str) -> tuple[str, int]:
    """Split a ``HOST:PORT`` listen address.

    Args:
        listen: ``127.0.0.1:9417``, ``0.0.0.0:9417``, ``[::1]:9417`` or ``[::]:9417``;
            port 0 picks a free port.

    Returns:
        The IP address (without brackets) and the port.

    Raises:
        MetricsError: Not an IP address and a port in 0..65535; the message says why.
    """
    example = "e.g. 127.0.0.1:9417 or [::1]:9417"
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host:
        raise MetricsError(f"metrics listen address {listen!r} is not HOST:PORT ({example})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        version = 6
    else:
        version = 4
    try:
        address = ipaddress.ip_address(host)
        port = int(port_text, 10)
    except ValueError:
        raise MetricsError(
            f"metrics listen address {listen!r} needs an IP address and a port ({example})"
        ) from None
    if address.version != version:
        raise MetricsError(f"metrics listen address {listen!r}: write IPv6 addresses in brackets")
    if not 0 <= port <= 65535:
        raise MetricsError(f"metrics listen address {listen!r}: port must be in 0..65535")
    return str(address), port


def _process_metrics() -> Callable[[], bytes]:
    """The ``process_*`` metrics: kiwid's own CPU, memory and file descriptors, as text."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    return lambda: generate_latest(registry)


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # seconds a client may take to send its request

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics %s: " + format, self.client_address[0], *args)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scraper must not hold stop() up

    def server_bind(self) -> None:
        # WSGIServer would look the host up in DNS (getfqdn); an address is enough.
        TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics`` over HTTP on a background thread.

    Args:
        listen: ``HOST:PORT`` (see `parse_listen`); port 0 picks a free one.
        snapshot: Returns the status object; called on the server's threads, so
            it must be thread-safe.
        process: Also export the ``process_*`` metrics of this process.

    Raises:
        MetricsError: ``listen`` is malformed.
    """

    def __init__(self, listen: str, snapshot: Snapshot, process: bool = True) -> None:
        self.listen = listen
        self.host, self._port = parse_listen(listen)
        self._snapshot = snapshot
        self._exposition = Exposition()
        self._process = _process_metrics() if process else None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def body(self) -> bytes:
        """What a scrape answers: kiwi_* from one snapshot, then ``process_*``."""
        text = self._exposition.render(self._snapshot()).encode()
        return text + self._process() if self._process else text

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        """The WSGI application: ``/metrics`` (GET or HEAD); anything else is 404."""
        path = environ.get("PATH_INFO") or "/"
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"kiwid serves its metrics on /metrics\n"]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        body = self.body()
        start_response(
            "200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))]
        )
        return [b"" if environ["REQUEST_METHOD"] == "HEAD" else body]

    @property
    def port(self) -> int:
        """The port in use (the one picked when ``listen`` said 0) once started."""
        return self._server.server_port if self._server else self._port

    def start(self) -> None:
        """Bind and serve on a daemon thread named ``kiwid-metrics``.

        Raises:
            MetricsError: The address cannot be bound (in use, not local, no
                permission); the message names it.
        """
        if self._server is not None:
            return
        cls = _Server6 if ":" in self.host else _Server
        try:
            server = make_server(self.host, self._port, self._app, cls, _QuietHandler)
        except OSError as exc:
            raise MetricsError(
                f"cannot serve metrics on {self.listen}: {exc.strerror or exc}"
            ) from exc
        assert isinstance(server, _Server)  # make_server built our class
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="kiwid-metrics"
        )
        self._thread.daemon = True
        self._thread.start()
        logger.info("Serving Prometheus metrics on http://%s/metrics", self._url_host())

    def _url_host(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def stop(self) -> None:
        """Stop serving, close the socket and join the thread (idempotent)."""
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()  # returns once serve_forever has left its loop
        server.server_close()
        if thread is not None:
            thread.join(5)
        self._server = self._thread = None
