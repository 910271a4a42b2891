"""The Prometheus text exposition (format 0.0.4) of kiwid's status object.

The text is written directly, not through ``prometheus_client``'s metric objects:
with 512 tenants (5,000 series) those cost tens of milliseconds of CPU a scrape.
A tenant's lines are kept between scrapes while its labels and values stay the
same (an idle tenant's never change), so a scrape formats only what moved.
``prometheus_client`` still provides the ``process_*`` metrics
(`kiwid.adapters.metrics.server`). Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kiwid.adapters.metrics.families import (
    _GPU_FAMILIES,
    _LEDGER_COUNTERS,
    _LEDGER_FIELDS,
    _TENANT_FAMILIES,
    HANDOVER,
    PREEMPTIONS,
    TENANT_LABELS,
)


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


def _stuck_operation(tenant: Mapping[str, Any]) -> str | None:
    """The operation that left a stuck tenant stuck (``None``: it is not stuck)."""
    if tenant.get("state") != "stuck":
        return None
    return str((tenant.get("stuck_reason") or {}).get("operation") or "unknown")


_TENANT_HEADERS = tuple(_header(*family) for family in _TENANT_FAMILIES)

# A tenant's series on one GPU are a pure function of this key: its labels, its
# ledger's values, its footprint, its declared memory, its gate failure, the
# operation it is stuck on, its swap refusal, its weight and priority.
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
                        tenant.get("declared_bytes"),
                        bool(tenant.get("gate_failure")),
                        _stuck_operation(tenant),
                        _refusal_reason(tenant.get("swap_refusal")),
                        policy.get("weight"),
                        policy.get("priority"),
                        tenant.get("state") == "parked",
                    )
                )
        for entry in departed:
            tid = entry.get("id")
            for gid, ledger in _gpu_ledgers(entry):
                if (_escape(tid), gid) in seen:  # back again: current wins
                    continue
                labels = (tid, entry.get("name"), entry.get("pod"), entry.get("namespace"), gid)
                values = [ledger.get(field) for field in _LEDGER_FIELDS]
                add((*labels, *values, None, None, False, None, None, None, None, None))
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
    footprint, declared, gate_failed, stuck, refusal, weight, priority, parked = key[
        5 + len(_LEDGER_FIELDS) :
    ]
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
    shown = "" if declared is None else _number(declared)
    lines.append(f"kiwi_tenant_declared_bytes{labels} {shown}\n" if shown else "")
    lines.append(f"kiwi_tenant_gate_failed{labels} 1\n" if gate_failed else "")
    operation = f'{labels[:-1]},operation="{_escape(stuck)}"}}'
    lines.append(f"kiwi_tenant_stuck{operation} 1\n" if stuck is not None else "")
    refused = f'{labels[:-1]},reason="{refusal}"}}'
    lines.append(f"kiwi_tenant_swap_refused{refused} 1\n" if refusal else "")
    lines.append("" if weight is None else f"kiwi_tenant_weight{labels} {_number(weight)}\n")
    lines.append("" if priority is None else f"kiwi_tenant_priority{labels} {_number(priority)}\n")
    lines.append("" if parked is None else f"kiwi_tenant_parked{labels} {int(parked)}\n")
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
    counters = status.get("counters") or {}
    reloads = counters.get("reloads") or {}
    wakes = counters.get("wakes")
    wasted = counters.get("restores_wasted")
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
            "kiwi_wakes_total",
            "counter",
            "Parked tenants woken since start, by reason (request: a client waited on one of "
            "its sockets; operator: kiwictl wake; policy: it could park no longer).",
            []
            if wakes is None
            else [
                f'kiwi_wakes_total{{reason="{reason}"}} {_number(wakes.get(reason, 0))}'
                for reason in ("request", "operator", "policy")
            ],
        ),
        (
            "kiwi_restores_wasted_total",
            "counter",
            "Restores since start after which the tenant did no GPU work in its turn "
            "(its memory moved back for nothing).",
            [] if wasted is None else [f"kiwi_restores_wasted_total {_number(wasted)}"],
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
