"""The metric families kiwid exports: their names, types, help texts and labels.

`METRIC_FAMILIES` names them all; `kiwid.adapters.metrics.exposition` writes them
in the order of these tables. Standard library only.
"""

from __future__ import annotations

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
# Per tenant, after the counters: (name, help). The gate, stuck and swap ones are
# present only for a tenant whose gate or swap failed, or that is stuck (labelled
# with the ``operation`` too); weight and priority only for a live tenant (from its
# resolved ``policy``).
_TENANT_GAUGES = (
    ("kiwi_tenant_footprint_bytes", "GPU memory the tenant uses (all its processes)."),
    (
        "kiwi_tenant_declared_bytes",
        "GPU memory the tenant declared it needs on each of its GPUs (kiwi.io/gpu-memory, "
        "register or a [[tenants]] rule's memory); absent when none. A footprint above it "
        "is a tenant that grew past its declaration: it is sized by what it uses.",
    ),
    (
        "kiwi_tenant_gate_failed",
        "1 while the tenant's freeze or lock did not take, so that it may run ungated (it is "
        "stuck, and nobody else is let go on its GPUs; its gate is tried again every TQ); "
        "absent otherwise.",
    ),
    (
        "kiwi_tenant_stuck",
        "1 while the tenant is stuck, by the operation that failed (gate, ungate, swap-out, "
        "swap-in, retry, release, adopt): it failed for good, ran past gpu.driver_timeout or "
        "left the driver out of step, and the tenant waits for kiwictl retry or release; "
        "absent otherwise.",
    ),
    (
        "kiwi_tenant_swap_refused",
        "1 while the tenant's last swap was not done, by reason (host_floor: the host RAM "
        "floor, other); absent otherwise.",
    ),
    ("kiwi_tenant_weight", "The tenant's weight: its quantum is TQ x weight."),
    ("kiwi_tenant_priority", "The tenant's priority class (higher first)."),
    (
        "kiwi_tenant_parked",
        "1 while the tenant is parked: idle, its memory in host RAM, out of the queue "
        "until a request waits on one of its sockets or kiwictl wake; 0 otherwise.",
    ),
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
        "The bound on the waiting tenant's wait, counted from its start: the holder's "
        "quantum, the quanta ahead (TQ x weight) and the hand-over allowance, plus one TQ "
        "per hand-over where memory swaps; absent where no bound holds (status says why).",
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
    "kiwi_wakes_total",
    "kiwi_restores_wasted_total",
    "kiwi_config_last_reload_successful",
    "kiwi_scheduling_enabled",
    "kiwi_build_info",
)
