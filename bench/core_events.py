"""Benchmark: scheduling-core events per second, 8 GPUs x 64 tenants.

The event mix is what kiwid feeds the core on every poll: a footprint and an
activity sample per running tenant, plus attach/detach churn and the deadline
ticks. Prints the machine it ran on. Target: >= 100,000 events/s.
"""

from __future__ import annotations

import platform
import random
import time

from kiwid.core.events import ActivitySeen, FootprintSeen, TenantAttached, TenantDetached, Tick
from kiwid.core.model import GpuPolicy, TenantState
from kiwid.core.scheduler import Scheduler

GPUS, PER_GPU, ROUNDS = 8, 64, 200


def main() -> None:
    rng = random.Random(7)
    policy = GpuPolicy(tq_s=1.0, idle_release_s=5.0)
    sched = Scheduler({str(g): policy for g in range(GPUS)})
    tenants = [(f"g{g}-t{i}", str(g)) for g in range(GPUS) for i in range(PER_GPU)]
    now = 0.0
    events = 0
    for tid, gpu in tenants:
        sched.handle(TenantAttached(tid, frozenset({gpu})), now)
        events += 1
    start = time.perf_counter()
    for _ in range(ROUNDS):
        now += 0.5  # one poll interval
        sched.handle(Tick(), now)
        events += 1
        deadline = sched.next_deadline()
        if deadline is not None and deadline <= now:
            sched.handle(Tick(), now)
            events += 1
        for tid, gpu in tenants:
            sched.handle(FootprintSeen(tid, gpu, 2**30), now)
            events += 1
            if sched.tenant_state(tid) is not TenantState.WAITING and rng.random() < 0.5:
                sched.handle(ActivitySeen(tid), now)
                events += 1
        tid, gpu = rng.choice(tenants)
        sched.handle(TenantDetached(tid), now)
        sched.handle(TenantAttached(tid, frozenset({gpu})), now)
        events += 2
    elapsed = time.perf_counter() - start
    print(
        f"machine: {platform.node()} {platform.machine()} {platform.processor() or ''} "
        f"python {platform.python_version()}"
    )
    print(
        f"core: {GPUS} GPUs x {PER_GPU} tenants, {events} events in {elapsed:.2f} s "
        f"= {events / elapsed:,.0f} events/s (target >= 100,000)"
    )


if __name__ == "__main__":
    main()
