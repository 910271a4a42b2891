"""Prometheus metrics: the only importer of ``prometheus_client``.

`Exposition` renders kiwid's status object (``docs/control-protocol.md``, the
``status`` command) as Prometheus text at each scrape; `MetricsServer` serves it
over HTTP on ``/metrics`` from a background thread. What a scrape shows is what
the snapshot returned, so tenants disappear from the exposition when the daemon
drops them from ``departed`` (which bounds label cardinality).

The text is written directly, not through ``prometheus_client``'s metric objects:
with 512 tenants (5,000 series) those cost tens of milliseconds of CPU a scrape.
A tenant's lines are kept between scrapes while its labels and values stay the
same (an idle tenant's never change), so a scrape formats only what moved.
``prometheus_client`` still provides the ``process_*`` metrics.

The snapshot callable runs on the HTTP server's threads, possibly several at
once: it must be thread-safe and cheap, e.g. return a dict the daemon's loop
rebuilt and swapped in whole (never one the loop is still mutating).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import TCPServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

logger = logging.getLogger("kiwid.metrics")

Snapshot = Callable[[], Mapping[str, Any]]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TENANT_LABELS = ("tenant", "name", "pod", "namespace", "gpu")
# (metric name, ledger field, help text); the ledger's seconds and bytes are cumulative.
_LEDGER_COUNTERS = (
    ("kiwi_tenant_holding_seconds_total", "holding_s", "Seconds the tenant held the GPU."),
    (
        "kiwi_tenant_entitled_seconds_total",
        "entitled_s",
        "Seconds of GPU time the tenant was entitled to: its weight over the weights of "
        "its class's bursting tenants, while its class was the highest bursting.",
    ),
    ("kiwi_tenant_waiting_seconds_total", "waiting_s", "Seconds the tenant waited (gated)."),
    ("kiwi_tenant_corunning_seconds_total", "corunning_s", "Seconds run un-gated with others."),
    ("kiwi_tenant_quanta_total", "quanta", "Quanta (exclusive turns) granted to the tenant."),
    ("kiwi_tenant_early_releases_total", "early_releases", "Turns given back early (idle)."),
    ("kiwi_tenant_swapped_out_bytes_total", "swapped_out_bytes", "GPU memory swapped out."),
    ("kiwi_tenant_swapped_in_bytes_total", "swapped_in_bytes", "GPU memory swapped back in."),
    ("kiwi_tenant_swap_seconds_total", "swap_s", "Seconds spent swapping GPU memory."),
)
PREEMPTIONS = "kiwi_tenant_preemptions_total"
# The ledger's ``preempted`` counts every preemption, ``preempted_priority`` those
# for a higher priority: the counter splits them by ``reason``.
_LEDGER_FIELDS = (
    *(field for _, field, _ in _LEDGER_COUNTERS),
    "preempted",
    "preempted_priority",
)
# Per tenant, after the counters: (name, help). The swap and gate ones are present
# only for a tenant whose last gate or swap failed; weight and priority only for a
# live tenant (from its resolved ``policy``).
_TENANT_GAUGES = (
    ("kiwi_tenant_footprint_bytes", "GPU memory the tenant uses (all its processes)."),
    (
        "kiwi_tenant_gate_failed",
        "1 while the tenant's last freeze or lock failed (it runs on ungated); absent otherwise.",
    ),
    (
        "kiwi_tenant_swap_refused",
        "1 while the tenant's last swap was not done, by reason (host_floor: the host RAM "
        "floor, other); absent otherwise.",
    ),
    ("kiwi_tenant_weight", "The tenant's weight: its quantum is TQ x weight."),
    ("kiwi_tenant_priority", "The tenant's priority class (higher first)."),
)
# The tenant families in the order of the exposition (and of a tenant's lines).
_TENANT_FAMILIES = (
    *((name, "counter", text) for name, _, text in _LEDGER_COUNTERS),
    (
        PREEMPTIONS,
        "counter",
        "Turns taken from the tenant, by reason (quantum: its quantum ended while others "
        "waited; priority: a tenant of a higher priority wanted the GPU).",
    ),
    *((name, "gauge", text) for name, text in _TENANT_GAUGES),
)
# Per GPU: (name, type, help, label names).
_GPU_FAMILIES = (
    ("kiwi_gpu_info", "gauge", "The GPU's UUID and model (always 1).", ("gpu", "uuid", "model")),
    ("kiwi_gpu_queue_length", "gauge", "Tenants waiting for the GPU.", ("gpu",)),
    (
        "kiwi_gpu_holder_info",
        "gauge",
        "The tenant holding the GPU (1; absent when free).",
        ("gpu", "tenant"),
    ),
    ("kiwi_gpu_tq_seconds", "gauge", "Time quantum in force.", ("gpu",)),
    ("kiwi_gpu_mode_info", "gauge", "Scheduling mode in force (1).", ("gpu", "mode")),
    ("kiwi_gpu_healthy", "gauge", "1 when the GPU answers, 0 when lost.", ("gpu",)),
    ("kiwi_gpu_memory_total_bytes", "gauge", "The GPU's memory.", ("gpu",)),
    (
        "kiwi_gpu_memory_resident_bytes",
        "gauge",
        "GPU memory of the tenants whose memory is on the card.",
        ("gpu",),
    ),
    (
        "kiwi_waiter_wait_seconds",
        "gauge",
        "Seconds the waiting tenant has waited for this GPU so far.",
        ("gpu", "tenant"),
    ),
    (
        "kiwi_waiter_position",
        "gauge",
        "The waiting tenant's place in the GPU's queue (1: next).",
        ("gpu", "tenant"),
    ),
    (
        "kiwi_waiter_wait_bound_seconds",
        "gauge",
        "The bound on the waiting tenant's wait: (waiters ahead + 1) x TQ + the hand-over "
        "allowance.",
        ("gpu", "tenant"),
    ),
)
HANDOVER = "kiwi_handover_duration_seconds"
# Families whose series are NAME_bucket, NAME_sum and NAME_count.
HISTOGRAM_FAMILIES = (HANDOVER,)
# Every metric family kiwid exports besides prometheus_client's process_* ones: what
# the shipped Prometheus rules and Grafana dashboard may query (a test checks them).
METRIC_FAMILIES: tuple[str, ...] = (
    *(family[0] for family in _TENANT_FAMILIES),
    *(family[0] for family in _GPU_FAMILIES),
    HANDOVER,
    "kiwi_reloads_total",
    "kiwi_config_last_reload_successful",
    "kiwi_scheduling_enabled",
    "kiwi_build_info",
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


def _escape(value: Any) -> str:
    """A label value as the text format writes it (None is the empty string)."""
    text = "" if value is None else str(value)
    if "\\" in text or '"' in text or "\n" in text:
        text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return text


def _number(value: Any) -> str:
    """A sample value as the text format writes it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return repr(number)


def _labels(pairs: Iterable[tuple[str, Any]]) -> str:
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs) + "}"


def _header(name: str, kind: str, text: str) -> str:
    return f"# HELP {name} {text}\n# TYPE {name} {kind}\n"


def _bound(le: Any) -> str:
    """A bucket's upper bound as Prometheus writes it (``0.005``, ``1.0``, ``+Inf``)."""
    if isinstance(le, str):
        return "+Inf" if le.lower() in ("+inf", "inf") else repr(float(le))
    return repr(float(le))


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


def _refusal_reason(text: Any) -> str | None:
    """``host_floor`` for a swap refused for the host RAM floor, ``other`` for any other."""
    if not text:
        return None
    return "host_floor" if str(text).startswith("host RAM floor") else "other"


_TENANT_HEADERS = tuple(_header(*family) for family in _TENANT_FAMILIES)

# A tenant's series on one GPU are a pure function of this key: its labels, its
# ledger's values, its footprint, its gate and swap failures, its weight and priority.
_TenantKey = tuple[Any, ...]


class Exposition:
    """Renders status objects as Prometheus text, reusing unchanged tenants' lines.

    Thread-safe: concurrent renders share only the cache, which each render
    replaces whole (a render that loses the race just recomputes a few lines).
    """

    def __init__(self) -> None:
        self._tenant_cache: dict[_TenantKey, tuple[str, ...]] = {}

    def render(self, status: Mapping[str, Any]) -> str:
        """The exposition of one status object (text format 0.0.4).

        Args:
            status: The status object; fields it lacks are left out of the text.

        Returns:
            Every kiwi_* family, with its HELP and TYPE lines, in a fixed order.
        """
        gpus: list[Mapping[str, Any]] = list(status.get("gpus") or [])
        return "".join(
            [
                *self._tenant_families(gpus, status.get("departed") or []),
                *_gpu_families(gpus),
                *_daemon_families(status),
            ]
        )

    def _tenant_families(
        self, gpus: list[Mapping[str, Any]], departed: Iterable[Mapping[str, Any]]
    ) -> list[str]:
        old = self._tenant_cache
        fresh: dict[_TenantKey, tuple[str, ...]] = {}
        rows: list[tuple[str, ...]] = []  # per tenant and GPU, a line (or "") per family
        seen: set[tuple[str, str]] = set()

        def add(key: _TenantKey) -> None:
            lines = fresh.get(key) or old.get(key) or _tenant_lines(key)
            fresh[key] = lines
            rows.append(lines)

        for gpu in gpus:
            gid = _escape(gpu.get("id"))
            for tenant in gpu.get("tenants") or []:
                ledger = tenant.get("ledger") or {}
                policy = tenant.get("policy") or {}
                size = ledger.get("footprint_bytes")
                tid = tenant.get("id")
                seen.add((_escape(tid), gid))
                add(
                    (
                        tid,
                        tenant.get("name"),
                        tenant.get("pod"),
                        tenant.get("namespace"),
                        gid,
                        *[ledger.get(field) for field in _LEDGER_FIELDS],
                        tenant.get("footprint_bytes") if size is None else size,
                        bool(tenant.get("gate_failure")),
                        _refusal_reason(tenant.get("swap_refusal")),
                        policy.get("weight"),
                        policy.get("priority"),
                    )
                )
        for entry in departed:
            tid = entry.get("id")
            for gid, ledger in _gpu_ledgers(entry):
                if (_escape(tid), gid) in seen:  # back again: current wins
                    continue
                labels = (tid, entry.get("name"), entry.get("pod"), entry.get("namespace"), gid)
                values = [ledger.get(field) for field in _LEDGER_FIELDS]
                add((*labels, *values, None, False, None, None, None))
        self._tenant_cache = fresh  # only what this scrape showed: bounded like the status
        columns = zip(*rows, strict=True) if rows else [()] * len(_TENANT_FAMILIES)
        return [
            header + "".join(column)
            for header, column in zip(_TENANT_HEADERS, columns, strict=True)
        ]


def _tenant_lines(key: _TenantKey) -> tuple[str, ...]:
    """One tenant's lines (or "") in each tenant family, from its cache key."""
    labels = _labels(zip(TENANT_LABELS, key[:5], strict=True))
    *values, preempted, by_priority = key[5 : 5 + len(_LEDGER_FIELDS)]
    footprint, gate_failed, refusal, weight, priority = key[5 + len(_LEDGER_FIELDS) :]
    lines = [
        "" if value is None else f"{name}{labels} {_number(value)}\n"
        for (name, _, _), value in zip(_LEDGER_COUNTERS, values, strict=True)
    ]
    if preempted is None:
        lines.append("")
    else:
        by_priority = by_priority or 0  # a ledger from before priorities: none of them
        reason = f"{PREEMPTIONS}{labels[:-1]},reason="
        lines.append(
            f'{reason}"quantum"}} {_number(preempted - by_priority)}\n'
            f'{reason}"priority"}} {_number(by_priority)}\n'
        )
    size = "" if footprint is None else _number(footprint)
    lines.append(f"kiwi_tenant_footprint_bytes{labels} {size}\n" if size else "")
    lines.append(f"kiwi_tenant_gate_failed{labels} 1\n" if gate_failed else "")
    refused = f'{labels[:-1]},reason="{refusal}"}}'
    lines.append(f"kiwi_tenant_swap_refused{refused} 1\n" if refusal else "")
    lines.append("" if weight is None else f"kiwi_tenant_weight{labels} {_number(weight)}\n")
    lines.append("" if priority is None else f"kiwi_tenant_priority{labels} {_number(priority)}\n")
    return tuple(lines)


def _gpu_families(gpus: list[Mapping[str, Any]]) -> list[str]:
    columns: dict[str, list[str]] = {family[0]: [] for family in _GPU_FAMILIES}
    handover: list[str] = []
    for gpu in gpus:
        gid = _escape(gpu.get("id"))
        one = f'{{gpu="{gid}"}}'
        columns["kiwi_gpu_info"].append(
            f'kiwi_gpu_info{{gpu="{gid}",uuid="{_escape(gpu.get("uuid"))}",'
            f'model="{_escape(gpu.get("name"))}"}} 1\n'
        )
        waiters = gpu.get("waiters") or []
        columns["kiwi_gpu_queue_length"].append(f"kiwi_gpu_queue_length{one} {len(waiters)}\n")
        holder = gpu.get("holder")
        if holder:
            tenant = _escape(holder.get("tenant"))
            columns["kiwi_gpu_holder_info"].append(
                f'kiwi_gpu_holder_info{{gpu="{gid}",tenant="{tenant}"}} 1\n'
            )
        for name, field in (
            ("kiwi_gpu_tq_seconds", "tq"),
            ("kiwi_gpu_memory_total_bytes", "memory_total_bytes"),
            ("kiwi_gpu_memory_resident_bytes", "memory_resident_bytes"),
        ):
            if gpu.get(field) is not None:
                columns[name].append(f"{name}{one} {_number(gpu[field])}\n")
        if gpu.get("mode") is not None:
            columns["kiwi_gpu_mode_info"].append(
                f'kiwi_gpu_mode_info{{gpu="{gid}",mode="{_escape(gpu["mode"])}"}} 1\n'
            )
        healthy = 1 if gpu.get("healthy", True) else 0
        columns["kiwi_gpu_healthy"].append(f"kiwi_gpu_healthy{one} {healthy}\n")
        for waiter in waiters:
            who = f'{{gpu="{gid}",tenant="{_escape(waiter.get("tenant"))}"}}'
            if waiter.get("waiting_s") is not None:
                wait = _number(waiter["waiting_s"])
                columns["kiwi_waiter_wait_seconds"].append(
                    f"kiwi_waiter_wait_seconds{who} {wait}\n"
                )
            if waiter.get("position") is not None:
                place = _number(waiter["position"])
                columns["kiwi_waiter_position"].append(f"kiwi_waiter_position{who} {place}\n")
            if waiter.get("wait_bound_s") is not None:
                bound = _number(waiter["wait_bound_s"])
                columns["kiwi_waiter_wait_bound_seconds"].append(
                    f"kiwi_waiter_wait_bound_seconds{who} {bound}\n"
                )
        handover.extend(_histogram(HANDOVER, gid, gpu.get("handover_seconds")))
    return [
        *(
            _header(name, kind, text) + "".join(columns[name])
            for name, kind, text, _ in _GPU_FAMILIES
        ),
        _header(
            HANDOVER, "histogram", "Time from a holder's preemption to the next holder's grant."
        )
        + "".join(handover),
    ]


def _histogram(name: str, gid: str, hist: Mapping[str, Any] | None) -> list[str]:
    if not hist:
        return []
    buckets = [(_bound(le), count) for le, count in hist.get("buckets") or []]
    if not buckets or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", hist.get("count", 0)))
    lines = [f'{name}_bucket{{gpu="{gid}",le="{le}"}} {_number(n)}\n' for le, n in buckets]
    lines.append(f'{name}_count{{gpu="{gid}"}} {_number(hist.get("count", 0))}\n')
    lines.append(f'{name}_sum{{gpu="{gid}"}} {_number(hist.get("sum", 0.0))}\n')
    return lines


def _daemon_families(status: Mapping[str, Any]) -> list[str]:
    reloads = (status.get("counters") or {}).get("reloads") or {}
    last = ((status.get("config") or {}).get("last_reload") or {}).get("ok")
    scheduling, version = status.get("scheduling"), status.get("version")
    # (name, type, help, its sample lines: none where the status lacks the field)
    families = (
        (
            "kiwi_reloads_total",
            "counter",
            "Configuration reloads since start, by result.",
            [
                f'kiwi_reloads_total{{result="{result}"}} {_number(reloads.get(result, 0))}'
                for result in ("ok", "failed")
            ],
        ),
        (
            "kiwi_config_last_reload_successful",
            "gauge",
            "1 when the last reload (or the start) applied the file, 0 when it was refused.",
            [] if last is None else [f"kiwi_config_last_reload_successful {int(bool(last))}"],
        ),
        (
            "kiwi_scheduling_enabled",
            "gauge",
            "1 while kiwid gates tenants, 0 while kiwictl -S off has turned it off.",
            [] if scheduling is None else [f"kiwi_scheduling_enabled {int(scheduling == 'on')}"],
        ),
        (
            "kiwi_build_info",
            "gauge",
            "kiwid's version (always 1).",
            [] if version is None else [f'kiwi_build_info{{version="{_escape(version)}"}} 1'],
        ),
    )
    return [
        _header(name, kind, text) + "".join(f"{line}\n" for line in lines)
        for name, kind, text, lines in families
    ]


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
