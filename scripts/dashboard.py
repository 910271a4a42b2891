"""Build Kiwi's Grafana dashboard (etc/grafana/kiwi.json) with grafana-foundation-sdk.

The dashboard reads the series kiwid exports and the recording rules of
etc/prometheus/kiwi.rules.yml; tests/prometheus/test_dashboard.py checks both and
that the committed JSON is what this script builds.

    .venv/bin/python scripts/dashboard.py           # write etc/grafana/kiwi.json
    .venv/bin/python scripts/dashboard.py --check   # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

OUT = Path(__file__).resolve().parents[1] / "etc" / "grafana" / "kiwi.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
NODE = 'instance=~"$instance"'
ON = f'{NODE},gpu=~"$gpu"'


def query(expr: str, legend: str = "") -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    return q.legend_format(legend) if legend else q


def series(
    title: str, unit: str, *targets: prometheus.Dataquery, text: str = ""
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(8).span(12)
    if text:
        panel = panel.description(text)
    for ref, target in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def single(title: str, expr: str, unit: str = "none", text: str = "") -> stat.Panel:
    panel = (
        stat.Panel()
        .title(title)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]))
        .with_target(query(expr).ref_id("A"))
    )
    return panel.description(text) if text else panel


def variable(name: str, label: str, values: str) -> dashboard.QueryVariable:
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({values})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def build() -> dashboard.Dashboard:
    """The dashboard: overview, tenants, weights and priorities, queue, hand-overs and
    memory, failures."""
    return (
        dashboard.Dashboard("Kiwi: shared GPUs")
        .uid("kiwi-gpu-sharing")
        .description("kiwid's rotation, queues, hand-overs and memory swaps (docs/monitoring.md)")
        .tags(["kiwi", "gpu"])
        .refresh("30s")
        .time("now-3h", "now")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
        .with_variable(variable("instance", "Node", 'kiwi_build_info{job="kiwid"}, instance'))
        .with_variable(variable("gpu", "GPU", 'kiwi_gpu_info{instance=~"$instance"}, gpu'))
        .with_row(dashboard.Row("Overview"))
        .with_panel(
            single("kiwid answering", f'sum(up{{job="kiwid",{NODE}}})', text="Nodes scraped.")
        )
        .with_panel(single("GPUs healthy", f"sum(kiwi_gpu_healthy{{{ON}}})"))
        .with_panel(single("Tenants waiting", f"sum(kiwi_gpu_queue_length{{{ON}}})"))
        .with_panel(
            single(
                "Refused reloads",
                f"count(kiwi_config_last_reload_successful{{{NODE}}} == 0) or vector(0)",
                text="Nodes whose last reload of /etc/kiwi.toml was refused.",
            )
        )
        .with_row(dashboard.Row("Tenants"))
        .with_panel(
            series(
                "Share of GPU time",
                "percentunit",
                query(f"kiwi:tenant_gpu_time_share:ratio_rate5m{{{ON}}}", "{{name}} (GPU {{gpu}})"),
                text="Each tenant's share of the time its GPU was held, over 5 minutes.",
            )
        )
        .with_panel(
            series(
                "Time waiting, per second",
                "percentunit",
                query(
                    f"rate(kiwi_tenant_waiting_seconds_total{{{ON}}}[5m])", "{{name}} (GPU {{gpu}})"
                ),
            )
        )
        .with_panel(
            series(
                "GPU memory per tenant",
                "bytes",
                query(f"kiwi_tenant_footprint_bytes{{{ON}}}", "{{name}} (GPU {{gpu}})"),
            )
        )
        .with_panel(
            series(
                "Quanta per minute",
                "none",
                query(f"60 * rate(kiwi_tenant_quanta_total{{{ON}}}[5m])", "{{name}} (GPU {{gpu}})"),
            )
        )
        .with_row(dashboard.Row("Weights and priorities"))
        .with_panel(
            series(
                "Entitled and received share",
                "percentunit",
                query(
                    f"kiwi:tenant_gpu_time_entitled_share:ratio_rate5m{{{ON}}}",
                    "{{name}} entitled (GPU {{gpu}})",
                ),
                query(
                    f"kiwi:tenant_gpu_time_share:ratio_rate5m{{{ON}}}",
                    "{{name}} received (GPU {{gpu}})",
                ),
                text="Each tenant's share of its GPU's time over 5 minutes: what its weight "
                "entitled it to within its priority class, and what it held.",
            )
        )
        .with_panel(
            series(
                "Preemptions per minute, by reason",
                "none",
                query(
                    f"60 * rate(kiwi_tenant_preemptions_total{{{ON}}}[5m])",
                    "{{name}} {{reason}} (GPU {{gpu}})",
                ),
                text="quantum: its quantum ended while others waited; priority: a tenant "
                "of a higher priority wanted the GPU.",
            )
        )
        .with_panel(
            series(
                "Weight",
                "none",
                query(f"kiwi_tenant_weight{{{ON}}}", "{{name}} (GPU {{gpu}})"),
                text="Its quantum is TQ x weight; shares within a priority class follow "
                "the weights.",
            )
        )
        .with_panel(
            series(
                "Priority",
                "none",
                query(f"kiwi_tenant_priority{{{ON}}}", "{{name}} (GPU {{gpu}})"),
                text="Higher first: a higher class preempts a lower holder.",
            )
        )
        .with_row(dashboard.Row("Queue"))
        .with_panel(
            series(
                "Waiting, by GPU",
                "none",
                query(f"kiwi_gpu_queue_length{{{ON}}}", "{{instance}} GPU {{gpu}}"),
            )
        )
        .with_panel(
            series(
                "Wait so far, and its bound",
                "s",
                query(f"kiwi_waiter_wait_seconds{{{ON}}}", "{{tenant}} waited"),
                query(f"kiwi_waiter_wait_bound_seconds{{{ON}}}", "{{tenant}} bound"),
                text="The bound: (waiters ahead + 1) x TQ + scheduler.handover_allowance.",
            )
        )
        .with_panel(
            series(
                "Queue wait, 95th percentile",
                "s",
                query(f"kiwi:gpu_queue_wait_seconds:p95_5m{{{ON}}}", "{{instance}} GPU {{gpu}}"),
            )
        )
        .with_panel(
            series(
                "Time quantum",
                "s",
                query(f"kiwi_gpu_tq_seconds{{{ON}}}", "{{instance}} GPU {{gpu}}"),
            )
        )
        .with_row(dashboard.Row("Hand-overs and memory"))
        .with_panel(
            series(
                "Hand-over, 95th percentile",
                "s",
                query(f"kiwi:gpu_handover_seconds:p95_5m{{{ON}}}", "{{instance}} GPU {{gpu}}"),
            )
        )
        .with_panel(
            series(
                "Swapped per minute",
                "bytes",
                query(f"kiwi:gpu_swapped_out_bytes:per_minute_rate5m{{{ON}}}", "out, GPU {{gpu}}"),
                query(f"kiwi:gpu_swapped_in_bytes:per_minute_rate5m{{{ON}}}", "in, GPU {{gpu}}"),
            )
        )
        .with_panel(
            series(
                "GPU memory used and declared, per tenant",
                "bytes",
                query(f"kiwi_tenant_footprint_bytes{{{ON}}}", "{{name}} uses (GPU {{gpu}})"),
                query(f"kiwi_tenant_declared_bytes{{{ON}}}", "{{name}} declared (GPU {{gpu}})"),
                text="What each tenant uses beside what it declared it needs "
                "(kiwi.io/gpu-memory, register or its rule's memory): one above its "
                "declaration grew past it, and is sized by what it uses (docs/memory.md).",
            )
        )
        .with_panel(
            series(
                "GPU memory on the card",
                "bytes",
                query(f"kiwi_gpu_memory_resident_bytes{{{ON}}}", "resident, GPU {{gpu}}"),
                query(f"kiwi_gpu_memory_total_bytes{{{ON}}}", "card, GPU {{gpu}}"),
            )
        )
        .with_row(dashboard.Row("Failures"))
        .with_panel(
            series(
                "Gates failing, swaps refused",
                "none",
                query(
                    f"sum by (gpu) (kiwi_tenant_gate_failed{{{ON}}})", "gate failed, GPU {{gpu}}"
                ),
                query(
                    f"sum by (gpu, reason) (kiwi_tenant_swap_refused{{{ON}}})",
                    "swap refused ({{reason}}), GPU {{gpu}}",
                ),
            )
        )
        .with_panel(
            series(
                "Stuck tenants",
                "none",
                query(
                    f"kiwi_tenant_stuck{{{ON}}}",
                    "{{tenant}}: its {{operation}} failed ({{instance}} GPU {{gpu}})",
                ),
                text="Each stuck tenant, by the operation that failed: it stays gated and "
                "holds nothing until kiwictl retry or release (docs/monitoring.md).",
            )
        )
        .with_panel(
            series(
                "Reloads",
                "none",
                query(f"increase(kiwi_reloads_total{{{NODE}}}[1h])", "{{result}}, {{instance}}"),
            )
        )
    )


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run scripts/dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
