"""Prometheus metrics: the only importer of ``prometheus_client``.

`KiwiCollector` turns kiwid's status object (``docs/control-protocol.md``, the
``status`` command) into metric families at each scrape; `MetricsServer` serves
them over HTTP on ``/metrics`` from a background thread. Nothing here keeps
state of its own: what a scrape shows is what the snapshot returned, so tenants
disappear from the exposition when the daemon drops them from ``departed``
(which bounds label cardinality).

The snapshot callable runs on the HTTP server's threads, possibly several at
once: it must be thread-safe and cheap, e.g. return a dict the daemon's loop
rebuilt and swapped in whole (never one the loop is still mutating).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import TCPServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector

logger = logging.getLogger("kiwid.metrics")

Snapshot = Callable[[], Mapping[str, Any]]

TENANT_LABELS = ("tenant", "name", "pod", "namespace", "gpu")
# (metric name, ledger field, help text); the ledger's seconds and bytes are cumulative.
_LEDGER_COUNTERS = (
    ("kiwi_tenant_holding_seconds_total", "holding_s", "Seconds the tenant held the GPU."),
    ("kiwi_tenant_waiting_seconds_total", "waiting_s", "Seconds the tenant waited (gated)."),
    ("kiwi_tenant_corunning_seconds_total", "corunning_s", "Seconds run un-gated with others."),
    ("kiwi_tenant_quanta_total", "quanta", "Quanta (exclusive turns) granted to the tenant."),
    ("kiwi_tenant_preemptions_total", "preempted", "Turns that ended at the quantum's end."),
    ("kiwi_tenant_early_releases_total", "early_releases", "Turns given back early (idle)."),
    ("kiwi_tenant_swapped_out_bytes_total", "swapped_out_bytes", "GPU memory swapped out."),
    ("kiwi_tenant_swapped_in_bytes_total", "swapped_in_bytes", "GPU memory swapped back in."),
    ("kiwi_tenant_swap_seconds_total", "swap_s", "Seconds spent swapping GPU memory."),
)


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


def _label(value: Any) -> str:
    return "" if value is None else str(value)


def _gpu_ledgers(entry: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(GPU, ledger) pairs of a departed tenant, as its live series were labelled.

    A tenant's ledger is the same on each of its GPUs (it holds all or none), so a
    flat ledger is repeated per GPU; a mapping GPU → ledger is also understood.
    """
    ledger = entry.get("ledger") or {}
    if ledger and all(isinstance(v, Mapping) for v in ledger.values()):
        yield from ((str(gpu), one) for gpu, one in ledger.items())
    elif ledger:
        yield from ((str(gpu), ledger) for gpu in entry.get("gpus") or [""])


class KiwiCollector:
    """A custom collector that reads kiwid's status object at every scrape.

    Args:
        snapshot: Returns the status object; called from the HTTP threads, so it
            must be thread-safe (see the module docstring).
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        """Nothing up front: registering must not call the snapshot."""
        return []

    def collect(self) -> Iterable[Metric]:
        """Build every metric family from one snapshot.

        Returns:
            The families, each with its samples.
        """
        status = self._snapshot()
        gpus: list[Mapping[str, Any]] = list(status.get("gpus") or [])
        return [
            *self._tenant_families(gpus, status.get("departed") or []),
            *self._gpu_families(gpus),
            self._reloads(status),
        ]

    @staticmethod
    def _tenant_families(
        gpus: list[Mapping[str, Any]], departed: Iterable[Mapping[str, Any]]
    ) -> list[Metric]:
        counters = [
            (CounterMetricFamily(name, text, labels=TENANT_LABELS), field)
            for name, field, text in _LEDGER_COUNTERS
        ]
        footprint = GaugeMetricFamily(
            "kiwi_tenant_footprint_bytes",
            "GPU memory the tenant uses (all its processes).",
            labels=TENANT_LABELS,
        )
        seen: set[tuple[str, str]] = set()

        def add(tenant: Mapping[str, Any], gpu: str, ledger: Mapping[str, Any]) -> None:
            labels = [_label(tenant.get(k)) for k in ("id", "name", "pod", "namespace")] + [gpu]
            seen.add((labels[0], gpu))
            for family, field in counters:
                if ledger.get(field) is not None:
                    family.add_metric(labels, float(ledger[field]))

        for gpu in gpus:
            gid = _label(gpu.get("id"))
            for tenant in gpu.get("tenants") or []:
                add(tenant, gid, tenant.get("ledger") or {})
                size = (tenant.get("ledger") or {}).get("footprint_bytes")
                size = tenant.get("footprint_bytes") if size is None else size
                if size is not None:
                    labels = [_label(tenant.get(k)) for k in ("id", "name", "pod", "namespace")]
                    footprint.add_metric([*labels, gid], float(size))
        for entry in departed:
            for gid, ledger in _gpu_ledgers(entry):
                if (_label(entry.get("id")), gid) not in seen:  # back again: current wins
                    add(entry, gid, ledger)
        return [*(family for family, _ in counters), footprint]

    @staticmethod
    def _gpu_families(gpus: list[Mapping[str, Any]]) -> list[Metric]:
        info = GaugeMetricFamily(
            "kiwi_gpu_info", "The GPU's UUID and model (always 1).", labels=["gpu", "uuid", "model"]
        )
        queue = GaugeMetricFamily(
            "kiwi_gpu_queue_length", "Tenants waiting for the GPU.", labels=["gpu"]
        )
        holder = GaugeMetricFamily(
            "kiwi_gpu_holder_info",
            "The tenant holding the GPU (1; absent when free).",
            labels=["gpu", "tenant"],
        )
        tq = GaugeMetricFamily("kiwi_gpu_tq_seconds", "Time quantum in force.", labels=["gpu"])
        mode = GaugeMetricFamily(
            "kiwi_gpu_mode_info", "Scheduling mode in force (1).", labels=["gpu", "mode"]
        )
        healthy = GaugeMetricFamily(
            "kiwi_gpu_healthy", "1 when the GPU answers, 0 when lost.", labels=["gpu"]
        )
        handover = HistogramMetricFamily(
            "kiwi_handover_duration_seconds",
            "Time from a holder's preemption to the next holder's grant.",
            labels=["gpu"],
        )
        for gpu in gpus:
            gid = _label(gpu.get("id"))
            info.add_metric([gid, _label(gpu.get("uuid")), _label(gpu.get("name"))], 1)
            queue.add_metric([gid], len(gpu.get("waiters") or []))
            if gpu.get("holder"):
                holder.add_metric([gid, _label(gpu["holder"].get("tenant"))], 1)
            if gpu.get("tq") is not None:
                tq.add_metric([gid], float(gpu["tq"]))
            if gpu.get("mode") is not None:
                mode.add_metric([gid, str(gpu["mode"])], 1)
            healthy.add_metric([gid], 1 if gpu.get("healthy", True) else 0)
            hist = gpu.get("handover_seconds")
            if hist:
                buckets = [(_bound(le), float(count)) for le, count in hist.get("buckets") or []]
                if not buckets or buckets[-1][0] != "+Inf":
                    buckets.append(("+Inf", float(hist.get("count", 0))))
                handover.add_metric([gid], buckets, float(hist.get("sum", 0.0)))
        return [info, queue, holder, tq, mode, healthy, handover]

    @staticmethod
    def _reloads(status: Mapping[str, Any]) -> Metric:
        family = CounterMetricFamily(
            "kiwi_reloads_total",
            "Configuration reloads since start, by result.",
            labels=["result"],
        )
        reloads = (status.get("counters") or {}).get("reloads") or {}
        for result in ("ok", "failed"):
            family.add_metric([result], float(reloads.get(result, 0)))
        return family


def _bound(le: Any) -> str:
    """A bucket's upper bound as Prometheus writes it (``0.005``, ``1.0``, ``+Inf``)."""
    if isinstance(le, str):
        return "+Inf" if le.lower() in ("+inf", "inf") else repr(float(le))
    return repr(float(le))


def build_registry(snapshot: Snapshot, process: bool = True) -> CollectorRegistry:
    """A private registry with kiwid's collector (and the ``process_*`` metrics).

    Args:
        snapshot: Returns the status object; must be thread-safe.
        process: Also export kiwid's own CPU, memory and file descriptors.

    Returns:
        The registry, for `MetricsServer` or ``prometheus_client.generate_latest``.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KiwiCollector(snapshot))
    if process:
        ProcessCollector(registry=registry)
    return registry


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
        self.registry = build_registry(snapshot, process)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

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
        app = make_wsgi_app(self.registry)
        try:
            server = make_server(self.host, self._port, app, cls, _QuietHandler)
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
