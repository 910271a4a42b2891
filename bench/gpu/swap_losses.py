"""The trainer's loss curve against its unswapped reference, step by step, to the bit.

The trainer (``train_worker.py``) logs every step's loss as ``float.hex`` and starts
again from its initial state (same weights, optimiser state, data) every ``cycle``
steps, so its step ``i`` must equal the reference's step ``i mod cycle`` exactly,
whenever the swaps fell. The reference is the same training run alone, ungated,
before kiwid starts, for ``cycle`` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swap_logs import KEvent, WorkerLog

FALLBACK = "pure-python"  # the trainer's model name when torch is missing (rehearsal)


@dataclass
class LossCheck:
    label: str
    model: str  # what trained, from the trainer's model line
    reference_steps: int  # the unswapped run's steps (one cycle)
    steps: int  # steps the rotated trainer logged
    compared: int  # steps compared with the reference (all of them, cycle by cycle)
    cycles: int  # cycles begun
    mismatches: int
    first_mismatch: tuple[int, str, str] | None  # step, its loss, the reference's
    stalls: int  # times the trainer was held up while it trained (gated, swapped)
    mid_cycle_stalls: int  # of those, between two steps of one cycle
    swap_ins: int  # kiwid's "Swapped in" lines for it while it trained
    swap_outs: int
    verdict: str
    ok: bool
    failed: bool  # the curves differ (ok False and failed False: could not be judged)

    @property
    def fallback(self) -> bool:
        return self.model.startswith(FALLBACK)


def compare_losses(
    label: str,
    log: WorkerLog,
    reference: WorkerLog | None,
    swaps: Sequence[KEvent],
    stalls: Sequence[tuple[float, float | None]],
    reference_2: WorkerLog | None = None,
) -> LossCheck:
    """Compare the trainer's losses with the reference's; count the swaps in between.

    With ``reference_2`` (a second unswapped run), there is a verdict only if the two
    agree: otherwise the training is not deterministic on its own here.
    """
    model = log.model or "?"
    ref = [h for _, _, h in sorted(reference.losses)] if reference is not None else []
    cycle = log.cycle or len(ref)
    losses = sorted(log.losses)
    steps = len(losses)
    t0 = losses[0][1] if losses else 0.0
    t1 = losses[-1][1] if losses else 0.0
    held = [(s, r) for s, r in stalls if t0 <= s < t1]
    mid = 0
    for s, _ in held:
        before = [step for step, t, _ in losses if t <= s]
        if before and (before[-1] + 1) % max(cycle, 1) != 0:
            mid += 1
    ins = sum(1 for e in swaps if e.kind == "swap-in" and e.who == label and t0 < e.t < t1)
    outs = sum(1 for e in swaps if e.kind == "swap-out" and e.who == label and t0 < e.t < t1)
    compared = mismatches = 0
    first: tuple[int, str, str] | None = None
    if ref and cycle == len(ref):
        for step, _, value in losses:
            want = ref[step % cycle]
            compared += 1
            if value != want:
                mismatches += 1
                first = first or (step, value, want)
    check = LossCheck(
        label=label,
        model=model,
        reference_steps=len(ref),
        steps=steps,
        compared=compared,
        cycles=-(-steps // cycle) if cycle else 0,
        mismatches=mismatches,
        first_mismatch=first,
        stalls=len(held),
        mid_cycle_stalls=mid,
        swap_ins=ins,
        swap_outs=outs,
        verdict="",
        ok=False,
        failed=False,
    )
    ref_2 = [h for _, _, h in sorted(reference_2.losses)] if reference_2 is not None else ref
    apart = next((k for k, (x, y) in enumerate(zip(ref, ref_2, strict=False)) if x != y), None)
    if reference is None or not ref:
        check.verdict = "no reference run to compare with"
    elif apart is not None or len(ref_2) != len(ref):
        check.verdict = (
            f"no verdict: the two unswapped runs differ (at step {apart}, or in length "
            f"{len(ref)} vs {len(ref_2)}): the training is not deterministic on its own here"
        )
    elif cycle != len(ref):
        check.verdict = f"the reference has {len(ref)} steps, the trainer's cycle is {cycle}"
    elif not losses:
        check.verdict = "the trainer logged no step"
    elif mismatches:
        step, got, want = first or (0, "", "")
        check.verdict = (
            f"DIFFERENT: {mismatches} of {compared} steps; first at step {step} "
            f"({float.fromhex(got)!r} vs {float.fromhex(want)!r} unswapped)"
        )
        check.failed = True
    elif not ins:
        check.verdict = (
            f"identical over {compared} steps, but it was never swapped in while it trained"
        )
    else:
        check.verdict = (
            f"bit-identical over {compared} steps ({check.cycles} cycle(s) of {cycle}), "
            f"across {ins} swap-in(s) and {mid} mid-cycle stall(s)"
        )
        check.ok = True
    if check.fallback:
        check.verdict += " [FALLBACK: pure-Python model, no torch: plumbing only]"
    return check
