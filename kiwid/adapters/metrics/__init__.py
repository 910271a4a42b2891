"""Prometheus metrics: the only importer of ``prometheus_client``.

`Exposition` renders kiwid's status object (``docs/control-protocol.md``, the
``status`` command) as Prometheus text at each scrape; `MetricsServer` serves it
over HTTP on ``/metrics`` from a background thread. What a scrape shows is what
the snapshot returned, so tenants disappear from the exposition when the daemon
drops them from ``departed`` (which bounds label cardinality).

* `families`: the metric families kiwid exports (names, types, help texts,
  labels) and `METRIC_FAMILIES`, what the shipped rules and dashboard may query.
* `exposition`: `Exposition`, the text rendering of a status object with its
  per-tenant line cache.
* `server`: `MetricsServer`, its listen address (`parse_listen`), the HTTP server
  and ``prometheus_client``'s ``process_*`` metrics.
"""

from __future__ import annotations

from kiwid.adapters.metrics.exposition import Exposition
from kiwid.adapters.metrics.families import (
    HANDOVER,
    HISTOGRAM_FAMILIES,
    METRIC_FAMILIES,
    PREEMPTIONS,
    TENANT_LABELS,
)
from kiwid.adapters.metrics.server import (
    CONTENT_TYPE,
    MetricsError,
    MetricsServer,
    Snapshot,
    parse_listen,
)

__all__ = [
    "CONTENT_TYPE",
    "HANDOVER",
    "HISTOGRAM_FAMILIES",
    "METRIC_FAMILIES",
    "PREEMPTIONS",
    "TENANT_LABELS",
    "Exposition",
    "MetricsError",
    "MetricsServer",
    "Snapshot",
    "parse_listen",
]
