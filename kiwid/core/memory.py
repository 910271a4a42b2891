"""GPU memory as the scheduler counts it: what takes room on a card, what can leave.

Pure functions over tenant records; the scheduler decides, this module counts.
Every tenant whose memory is on a card, or moving onto or off it, takes its room
there (a checkpoint frees the card only when it is done; a restore takes its room
from the moment it starts), so a plan built on these counts never asks the card
for more than it has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kiwid.core.model import GpuId, GpuPolicy, Newcomer, SwapMode, TenantState
from kiwid.core.residency import Residency
from kiwid.core.tenant import TenantRecord

S = TenantState
R = Residency
GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes as an operator reads them: ``4.0 GiB``."""
    return f"{nbytes / GIB:.1f} GiB"


def room(policy: GpuPolicy) -> int:
    """What tenants may take on a card: its memory less the reserve."""
    return max(0, policy.capacity_bytes - policy.reserve_bytes)


def occupied(members: Iterable[TenantRecord], gpu: GpuId, exclude: TenantRecord | None) -> int:
    """The bytes on ``gpu`` (or moving onto or off it), ``exclude`` left out."""
    return sum(t.size(gpu) for t in members if t is not exclude and t.memory.residency.takes_room)


def host_size(tenant: TenantRecord, gpu: GpuId, policy: GpuPolicy | None) -> int:
    """What ``tenant``'s memory on ``gpu`` takes in host RAM, as the state file records it.

    What it holds by what was seen of it; a tenant nobody saw use memory yet counts
    as what it declared, else as the whole card: an unknown footprint is never 0,
    or a restore would be let start with no room kept for it.
    """
    held = tenant.held(gpu) or tenant.cls.policy.memory_bytes or 0
    return held or (room(policy) if policy is not None else 0)


def wants_whole_card(tenant: TenantRecord, policy: GpuPolicy) -> bool:
    """Whether ``tenant`` gets the card to itself on its turn: a newcomer, by policy.

    A tenant whose working set nobody knows (it never held the GPU, its workload
    never ran before and it declared nothing) has shown only what it allocated while
    it waited; once let go it may take everything, so by default (``newcomer =
    "whole-card"``) every other tenant's memory leaves first. One that declared its
    memory needs that much: only the tenants that must go to make room for it go.
    """
    return not tenant.sized and policy.newcomer is Newcomer.WHOLE_CARD


def need(tenant: TenantRecord, gpu: GpuId, policy: GpuPolicy) -> int:
    """What ``tenant`` needs on ``gpu``: its size, or the whole card (a newcomer).

    Its size is the largest of what it was seen using, what its workload used and
    what it declared; only a newcomer nobody knows that declared nothing gets the
    whole card (by policy).
    """
    return room(policy) if wants_whole_card(tenant, policy) else tenant.size(gpu)


def restoring(members: Iterable[TenantRecord], gpu: GpuId, exclude: TenantRecord | None) -> int:
    """The bytes of the restores in flight on ``gpu``.

    Counted whole: they may be anywhere between starting and done when the card's
    free memory is read.
    """
    return sum(
        t.size(gpu)
        for t in members
        if t is not exclude and t.memory.residency in (Residency.SWAPPING_IN, Residency.PREFETCHING)
    )


@dataclass(frozen=True)
class HostMemory:
    """Host RAM for swap-outs: the last reading and the floor to keep."""

    available: int | None = None
    """Bytes available at the last reading (``None``: not read yet, no floor applies)."""
    floor: int = 0

    def refusal(self, nbytes: int, leaving: int) -> str | None:
        """Why a swap-out of ``nbytes`` may not go now (``None``: it may).

        ``leaving`` is what swap-outs in flight will take besides.
        """
        if self.available is None or self.floor <= 0:
            return None
        left = self.available - leaving - nbytes
        if left >= self.floor:
            return None
        return (
            f"host RAM floor: swapping out {gib(nbytes)} would leave {gib(max(0, left))} "
            f"available, below memory.host_floor_mib ({gib(self.floor)})"
        )


def victims(
    tenant: TenantRecord,
    gpu: GpuId,
    members: Iterable[TenantRecord],
    shortfall: int,
    swap_gpus: Mapping[GpuId, SwapMode],
    *,
    everyone: bool,
) -> list[TenantRecord]:
    """Resident tenants to swap out so that ``shortfall`` bytes free up on ``gpu``.

    Only those not running (waiting, or idle: they are gated first), whose memory
    may move (no refusal, gated in fact) and who use the card at all; the least
    recently run first (one brought back for its coming turn last). All of them
    if ``everyone`` (``tenant`` gets the card to itself).
    """
    if swap_gpus.get(gpu, SwapMode.NONE) is SwapMode.NONE:
        return []
    candidates = sorted(
        (
            o
            for o in members
            if o is not tenant
            and o.memory.residency.on_card
            and o.state in (S.WAITING, S.IDLE)
            and o.movable
            and o.size(gpu)
            and all(swap_gpus.get(g, SwapMode.NONE) is not SwapMode.NONE for g in o.gpus)
        ),
        key=lambda o: (o.memory.residency is R.PREFETCHED, o.turn.last_run, o.seq),
    )
    chosen: list[TenantRecord] = []
    freed = 0
    for victim in candidates:
        if not everyone and freed >= shortfall:
            break
        chosen.append(victim)
        freed += victim.size(gpu)
    return chosen
