"""What goes into the scheduling core: the events the shell reports.

Every action about one tenant carries the tenant's *epoch* as the core had it
when it asked, and every result the shell reports echoes it back. The core counts
a result only at the tenant's current epoch; a result of an older one (a job that
returned after a let-go, a fault, an operator's word) is old news: the core asks
for a :class:`~kiwid.core.actions.Converge`, which reads the truth and drives it to
what is wanted now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kiwid.core.model import GpuId, GpuPolicy, TenantId, TenantPolicy
from kiwid.core.residency import Residency

# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class GpusConfigured:
    """The set of managed GPUs and each one's policy (start, reload, runtime change).

    GPUs missing from ``policies`` are no longer arbitrated: their tenants stop
    waiting for them.
    """

    policies: Mapping[GpuId, GpuPolicy]
    host_floor_bytes: int = 0
    """Available host RAM that a swap-out must leave (``memory.host_floor_mib``)."""


@dataclass(frozen=True)
class TenantAttached:
    """A tenant appeared on ``gpus``, or its set of GPUs changed."""

    tenant: TenantId
    gpus: frozenset[GpuId]


@dataclass(frozen=True)
class TenantDetached:
    """A tenant is gone (its processes exited). No action is emitted for it."""

    tenant: TenantId


@dataclass(frozen=True)
class ActivitySeen:
    """The tenant did GPU work in the last sampling window."""

    tenant: TenantId


@dataclass(frozen=True)
class FootprintSeen:
    """The tenant's GPU memory on one GPU, in bytes (``None``: unknown)."""

    tenant: TenantId
    gpu: GpuId
    used_bytes: int | None


@dataclass(frozen=True)
class SwapFinished:
    """The shell carried out a :class:`SwapOut` or :class:`SwapIn` (or could not).

    A failed swap-out leaves the tenant's memory on the card (gated, intact); a
    failed swap-in leaves it in host RAM (gated). Either way the rotation goes on.
    """

    tenant: TenantId
    direction: str
    """``"out"`` or ``"in"``."""
    ok: bool
    moved_bytes: int = 0
    seconds: float = 0.0
    reason: str = ""
    """Why it failed (empty when it worked)."""
    deferred: bool = False
    """A restore that did not start: the card's free memory was short (no penalty:
    it starts once a reading shows the room)."""
    unswappable: bool = False
    """A swap-out refused for good: the driver cannot checkpoint this tenant (its
    memory stays on the card from now on)."""
    epoch: int = field(kw_only=True)
    """The epoch of the swap it answers."""


@dataclass(frozen=True)
class Gated:
    """The shell carried out a :class:`Gate`: the tenant's freeze or lock took.

    Until then a tenant asked to be gated may still run, so nobody else is let go on
    its GPUs (at most one tenant runs per GPU, also while a gate is under way).
    """

    tenant: TenantId
    epoch: int = field(kw_only=True)


@dataclass(frozen=True)
class Ungated:
    """The shell carried out an :class:`Ungate`: the tenant runs from now.

    Its window to show GPU work (``idle_release``) starts here, not when the ungate
    was asked: a tenant whose unlock is slow cannot show work meanwhile, and taking
    its silence for idleness would let the next one go while the unlock may still
    return, and both would run.
    """

    tenant: TenantId
    epoch: int = field(kw_only=True)


@dataclass(frozen=True)
class TenantFaulted:
    """An operation on the tenant failed for good: the tenant is stuck.

    The operation failed in a way retries cannot mend, ran past its deadline, or
    left the driver out of step. It holds nothing and is never let go until an
    operator asks (:class:`RetryAsked`, :class:`ReleaseAsked`); its memory is not
    moved again. ``contained``: kiwid knows it does not run (gated, locked, or
    fenced with the freezer); a tenant that may run keeps everyone else off its
    GPUs, and its gate is tried again every TQ.
    """

    tenant: TenantId
    operation: str
    """What kiwid was doing: ``gate``, ``ungate``, ``swap-out``, ``swap-in``, ``retry``,
    ``release`` or ``adopt``."""
    reason: str
    """What went wrong, for the operator: the pid, the call, the driver's answer."""
    memory: Residency | None = None
    """Where its memory is by the driver: ``RESIDENT``, ``HOST`` or ``UNKNOWN``
    (``None``: where the scheduler last put it)."""
    contained: bool = True
    pid: int | None = None
    """The process the failing call was about, if one."""
    answer: str | None = None
    """What the driver (or the kernel) answered, e.g. ``CUDA_ERROR_OPERATING_SYSTEM (304)``."""
    epoch: int = field(kw_only=True)
    """The epoch of the job that failed: a fault of an older one is old news."""


@dataclass(frozen=True)
class RetryAsked:
    """An operator asked kiwid to try a stuck (or released) tenant again (``kiwictl retry``).

    A stuck one is mended by the shell (:class:`Retry`, answered by :class:`Mended` or
    another :class:`TenantFaulted`); a released one goes back into the rotation.
    """

    tenant: TenantId


@dataclass(frozen=True)
class Mended:
    """The shell mended a stuck tenant: it is gated, and its memory is where ``memory`` says."""

    tenant: TenantId
    memory: Residency
    """``RESIDENT`` or ``HOST``."""
    epoch: int = field(kw_only=True)


@dataclass(frozen=True)
class ReleaseAsked:
    """An operator asked kiwid to let a stuck tenant run ungated (``kiwictl release``)."""

    tenant: TenantId


@dataclass(frozen=True)
class Released:
    """The shell carried out a :class:`Release`.

    ``complete``: everything was thawed, unlocked and brought back to the card: the
    tenant runs ungated, outside the rotation. Otherwise it stays stuck, and
    ``note`` says what could not be done (``contained``: whether it may run).
    """

    tenant: TenantId
    complete: bool
    note: str = ""
    contained: bool = True
    epoch: int = field(kw_only=True)


@dataclass(frozen=True)
class TenantAdopted:
    """A tenant that a previous kiwid left gated (found in the state file at start).

    It is attached already. It waits for its turn, gated; ``swapped`` gives its
    bytes per GPU if its memory is in host RAM. For the first ``idle_release``
    seconds it claims no GPU, so that a tenant that runs ungated can show its
    activity and keep the GPU it was given.
    """

    tenant: TenantId
    swapped: Mapping[GpuId, int] | None = None


@dataclass(frozen=True)
class WakeAsked:
    """Wake a parked tenant: it joins the queue as a burst (nothing if it is not parked).

    ``reason``: ``request`` (a request waits on one of its sockets, seen by the
    shell), or ``operator`` (``kiwictl wake``, or a router's ``wake`` command);
    ``detail`` says what waits, or who asked.
    """

    tenant: TenantId
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class TenantPolicySet:
    """A tenant's weight, priority, TQ and swap policy (set, or changed)."""

    tenant: TenantId
    policy: TenantPolicy


@dataclass(frozen=True)
class Admitted:
    """A container was announced to start held (``kubernetes.admission = "hold"``).

    If a GPU it needs is held or claimed it starts a burst at once and waits,
    gated, before its first instruction; otherwise nothing happens (it runs free
    until its first burst).
    """

    tenant: TenantId


@dataclass(frozen=True)
class HostMemorySeen:
    """The host RAM available to new allocations (bytes), for the swap floor."""

    available_bytes: int


@dataclass(frozen=True)
class MemoryFreeSeen:
    """A GPU's free memory as the driver reports it (bytes), for safe restores.

    The core's own count of what is on a card cannot see memory that nobody it
    knows took (the driver, a process it cannot see); a restore starts only when
    this reading leaves room for it beside the restores in flight.
    """

    gpu: GpuId
    free_bytes: int


@dataclass(frozen=True)
class FootprintRemembered:
    """A new tenant's workload ran before: its peak footprint then, in bytes.

    Sizes it from the start (a known working set, not the whole card).
    """

    tenant: TenantId
    peak_bytes: int


@dataclass(frozen=True)
class TenantUnswappable:
    """The tenant's memory can never leave its cards (the driver cannot checkpoint it).

    It is gated resident and the rotation goes on around it; ``reason`` says why.
    """

    tenant: TenantId
    reason: str


@dataclass(frozen=True)
class Converged:
    """The shell carried out a :class:`Converge` (or a :class:`Fence`): the truth it found.

    What the core wanted (:class:`Want`) is where the tenant is now, as far as the
    shell could drive it: ``runs`` whether a process of it runs (unlocked, unfrozen),
    ``memory`` where the driver has its memory (``RESIDENT``, ``HOST`` or
    ``UNKNOWN``), ``host_bytes`` what of it the state file records in host RAM,
    per GPU (``None``: nothing). A want it could not reach comes as a
    :class:`TenantFaulted` instead.
    """

    tenant: TenantId
    runs: bool
    memory: Residency | None
    host_bytes: Mapping[GpuId, int] | None = None
    note: str = ""
    """What it did, for the log (empty: nothing needed doing)."""
    epoch: int = field(kw_only=True)
    """The epoch of the want it drove to."""


@dataclass(frozen=True)
class JobOverdue:
    """A job of the tenant ran past its deadline: its driver call has not returned.

    The tenant is stuck, whatever its epoch: its jobs run one at a time, and this
    one keeps the tenant's lane until its call returns. ``may_run``: the call may
    leave the tenant running (a lock, an unlock): it is fenced with the freezer.
    """

    tenant: TenantId
    operation: str
    reason: str
    may_run: bool
    moving: bool = False
    """The call moves memory: where it is, is unknown until it returns."""
    epoch: int = field(kw_only=True)


@dataclass(frozen=True)
class MemorySplit:
    """A gated tenant whose memory is in host RAM has processes on the card, locked.

    A process it started since its swap-out (a follow locked it) holds room that the
    others count on: the core asks for a :class:`Converge`, which moves it there too.
    """

    tenant: TenantId
    pids: tuple[int, ...]
    epoch: int = field(kw_only=True)


@dataclass(frozen=True)
class Tick:
    """Only time passed (the shell woke for ``next_deadline``)."""


Event = (
    GpusConfigured
    | TenantAttached
    | TenantDetached
    | ActivitySeen
    | FootprintSeen
    | SwapFinished
    | Gated
    | Ungated
    | TenantFaulted
    | RetryAsked
    | Mended
    | ReleaseAsked
    | Released
    | TenantAdopted
    | TenantPolicySet
    | WakeAsked
    | Admitted
    | HostMemorySeen
    | MemoryFreeSeen
    | FootprintRemembered
    | TenantUnswappable
    | Converged
    | JobOverdue
    | MemorySplit
    | Tick
)
