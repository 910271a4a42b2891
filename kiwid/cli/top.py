"""``kiwictl top``: a live, full-screen view of every GPU, like nvidia-smi or nvitop.

Each frame comes from one ``status`` answer (``docs/control-protocol.md``):
the holder and its remaining quantum, the queue with waits and ETAs, a swap in
progress, and per tenant its state and share of GPU time. Shares are computed
here, from successive ``holding_s`` ledger samples kept in a sliding window;
until the window is full they are shares since kiwid started.

``render`` is pure (status in, lines out); ``run`` owns the terminal: the
alternate screen, no echo, ``q`` or Ctrl-C to quit, and the terminal restored
whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket as socketlib
import sys
import termios
import textwrap
import time
import tty
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from kiwid.adapters.control import ControlError, DaemonUnreachable, request
from kiwid.cli.explain import format_bytes, format_duration, waiter_eta
from kiwid.cli.parking_text import parked_clause

DEFAULT_INTERVAL_S = 1.0
DEFAULT_WINDOW_S = 300.0
_BAR = 16  # characters of the quantum and share bars
_ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, hide the cursor
_LEAVE = "\x1b[?25h\x1b[?1049l"
Key = tuple[str, str]  # (tenant, GPU)
_QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # quit like Ctrl-C: through KeyboardInterrupt


class ShareTracker:
    """Each tenant's share of each GPU's time over a sliding window.

    Samples are (kiwid's uptime, ``holding_s`` per tenant and GPU); the share
    is the growth of ``holding_s`` over the window divided by the window. Until
    the samples span the window it is ``holding_s / uptime``: the share since
    kiwid started. A smaller uptime than the last sample means kiwid restarted,
    and the history is dropped.

    Args:
        window_s: The window, seconds.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[Key, float]]] = deque()
        self._uptime_known = False

    def add(self, status: Mapping[str, Any], now_s: float) -> None:
        """Record one status answer.

        Args:
            status: The ``status`` result.
            now_s: This client's monotonic time, used when kiwid gives no ``uptime_s``.
        """
        uptime = status.get("uptime_s")
        self._uptime_known = uptime is not None
        at = float(uptime) if uptime is not None else now_s
        if self._samples and at < self._samples[-1][0]:
            self._samples.clear()
        held: dict[Key, float] = {}
        for gpu in status.get("gpus") or []:
            for t in gpu.get("tenants") or []:
                ledger = t.get("ledger") or {}
                if ledger.get("holding_s") is not None:
                    held[(str(t["id"]), str(gpu["id"]))] = float(ledger["holding_s"])
        self._samples.append((at, held))
        # Keep one sample at or before the window's start, so the span can cover it.
        while len(self._samples) > 1 and self._samples[1][0] <= at - self.window_s:
            self._samples.popleft()

    @property
    def full(self) -> bool:
        """Whether the samples span the whole window."""
        return bool(self._samples) and (self._samples[-1][0] - self._samples[0][0] >= self.window_s)

    def label(self) -> str:
        """The column heading: ``SHARE 5m``, or ``SHARE all`` (since kiwid started)."""
        if self.full or not self._uptime_known:
            return f"SHARE {format_duration(self.window_s).replace('m00s', 'm').replace(' ', '')}"
        return "SHARE all"

    def share(self, tenant: str, gpu: str) -> float | None:
        """The tenant's fraction of the GPU's time (0..1), or ``None`` if unknown.

        Args:
            tenant: Tenant id.
            gpu: GPU id.

        Returns:
            The share over the window, or since kiwid started while the window fills.
        """
        if not self._samples:
            return None
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        if (tenant, gpu) not in last:
            return None
        if self.full or not self._uptime_known:
            span = t1 - t0
            return (
                None if span <= 0 else (last[(tenant, gpu)] - first.get((tenant, gpu), 0.0)) / span
            )
        return last[(tenant, gpu)] / t1 if t1 > 0 else None


def _bar(fraction: float) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * _BAR)
    return "█" * filled + "░" * (_BAR - filled)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _holder_line(gpu: Mapping[str, Any]) -> str:
    holder = gpu.get("holder")
    if holder is None:
        return "  holder   none (the GPU is free)"
    since, left = float(holder.get("since_s") or 0.0), holder.get("remaining_s")
    text = f"  holder   {holder['tenant']}  held {format_duration(since)}"
    if left is None:
        return f"{text}, keeps it while nobody waits"
    bar = _bar(since / (since + left) if since + left > 0 else 1.0)
    return f"{text}, quantum ends in {format_duration(left)}  {bar}"


def _queue_lines(gpu: Mapping[str, Any]) -> list[str]:
    waiters = gpu.get("waiters") or []
    if not waiters:
        return ["  queue    empty"]
    lines = []
    for i, w in enumerate(waiters):
        eta, estimated = waiter_eta(gpu, w)
        label = "  queue    " if i == 0 else "           "
        lines.append(
            f"{label}{w.get('position', i + 1)}. {w['tenant']}  waiting "
            f"{format_duration(w.get('waiting_s'))}, turn in {'~' if estimated else ''}"
            f"{format_duration(eta)}"
        )
    return lines


def _swap_line(gpu: Mapping[str, Any]) -> list[str]:
    swap = gpu.get("swap")
    if not swap:
        return []
    total, done = swap.get("bytes") or 0, swap.get("done_bytes") or 0
    pct = f" ({100 * done / total:.0f}%)" if total else ""
    rate = swap.get("rate_bytes_s")
    speed = f" at {format_bytes(rate)}/s" if rate else ""
    return [
        f"  swap     {swap.get('direction')} {swap.get('tenant')}  "
        f"{format_bytes(done)} of {format_bytes(total)}{pct}{speed}"
    ]


def _parked_lines(gpu: Mapping[str, Any]) -> list[str]:
    parked = [t for t in gpu.get("tenants") or [] if t.get("state") == "parked"]
    return [
        f"{'  parked   ' if i == 0 else '           '}{t['id']}: "
        f"{parked_clause(t).removeprefix('parked ')}"
        for i, t in enumerate(parked)
    ]


def _tenant_rows(gpu: Mapping[str, Any], shares: ShareTracker, width: int) -> list[str]:
    tenants = gpu.get("tenants") or []
    if not tenants:
        return ["  no tenants"]
    gid = str(gpu.get("id"))
    longest = max(len("TENANT"), *(len(str(t["id"])) for t in tenants))
    # Besides the tenant and share columns a row takes 68 characters; the share's
    # bar is drawn where it fits, else the ids are cut (to 12 at least).
    bar = width >= longest + 68 + 10 + _BAR
    share_w = 10 + _BAR if bar else 9
    id_w = min(longest, max(12, width - 68 - share_w))
    head = f"{shares.label():<{share_w}}"
    rows = [
        f"  {'TENANT':<{id_w}}  {'STATE':<9}  {head}  {'ENTITLED':>8}  {'W/PRIO':>6}  "
        f"{'HELD':>7}  QUANTA  {'WAITED':>7}  MEMORY"
    ]
    for t in tenants:
        ledger = t.get("ledger") or {}
        share = shares.share(str(t["id"]), gid)
        share_text = "-" if share is None else f"{100 * share:5.1f}%"
        if bar and share is not None:
            share_text += f"   {_bar(share)}"
        held = format_duration(ledger["holding_s"]) if "holding_s" in ledger else "-"
        waited = format_duration(ledger["waiting_s"]) if "waiting_s" in ledger else "-"
        quanta = str(ledger.get("quanta", "-"))
        state = str(t.get("state")) + ("!" if t.get("gate_failure") else "")
        entitled = (t.get("share") or {}).get("entitled")
        entitled_text = "-" if entitled is None else f"{100 * entitled:5.1f}%"
        policy = t.get("policy") or {}
        weight_prio = f"{policy['weight']:g}/{policy['priority']}" if policy else "-"
        rows.append(
            f"  {_cut(str(t['id']), id_w):<{id_w}}  {state:<9}  {share_text:<{share_w}}  "
            f"{entitled_text:>8}  {weight_prio:>6}  "
            f"{held:>7}  {quanta:>6}  {waited:>7}  {format_bytes(t.get('footprint_bytes'))}"
        )
    return rows


def _gpu_lines(gpu: Mapping[str, Any], shares: ShareTracker, width: int) -> list[str]:
    tq, tq_conf = gpu.get("tq"), gpu.get("tq_configured")
    tq_text = f"TQ {format_duration(tq) if tq is not None else '?'}"
    if tq_conf is not None and tq != tq_conf:
        tq_text += f" (file {format_duration(tq_conf)})"
    mode = str(gpu.get("mode")) + (", contended" if gpu.get("contended") else "")
    title = f"GPU {gpu.get('id')} · {gpu.get('name')} · {tq_text} · {mode}"
    if not gpu.get("healthy", True):
        title += " · UNHEALTHY"
    hist = gpu.get("handover_seconds") or {}
    if hist.get("count"):
        mean = float(hist.get("sum", 0.0)) / int(hist["count"])
        title += f" · {hist['count']} hand-overs, mean {mean * 1000:.0f} ms"
    return [
        title,
        _holder_line(gpu),
        *_queue_lines(gpu),
        *_swap_line(gpu),
        *_parked_lines(gpu),
        *_tenant_rows(gpu, shares, width),
    ]


def render(
    status: Mapping[str, Any] | None,
    shares: ShareTracker,
    *,
    node: str,
    width: int | None = None,
    height: int | None = None,
    error: str | None = None,
) -> list[str]:
    """Lay out one frame.

    Args:
        status: The ``status`` result, or ``None`` when kiwid did not answer.
        shares: The share history (already fed with ``status``).
        node: This machine's name, for the header.
        width: Cut every line to this many characters (``None``: no limit).
        height: At most this many lines, the last saying how many were left out.
        error: Shown under the header instead of the GPUs (kiwid unreachable).

    Returns:
        The lines, without newlines.
    """
    head = f"kiwi top · {node}"
    lines: list[str] = []
    if status is not None:
        uptime = status.get("uptime_s")
        up = f" · up {format_duration(uptime)}" if uptime is not None else ""
        head += f" · kiwid {status.get('version')} (pid {status.get('pid')}){up}"
        head += f" · scheduling {status.get('scheduling')}"
    lines.append(f"{head} · {time.strftime('%H:%M:%S')} · q quits")
    if error is not None:
        lines += ["", *textwrap.wrap(error, width or len(error))]
    elif status is not None:
        for gpu in status.get("gpus") or []:
            lines += ["", *_gpu_lines(gpu, shares, width or 1000)]
        if not status.get("gpus"):
            lines += ["", "no GPUs"]
    if height is not None and len(lines) > height:
        hidden = len(lines) - height + 1
        lines = [*lines[: height - 1], f"… {hidden} more lines: enlarge the terminal"]
    return [_cut(line, width) for line in lines] if width else lines


@contextlib.contextmanager
def _screen(out: TextIO, keys: int | None) -> Iterator[None]:
    """Alternate screen, hidden cursor, keys unechoed; all undone on the way out."""
    saved = termios.tcgetattr(keys) if keys is not None else None
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in _QUIT_SIGNALS}
    try:
        if keys is not None:
            tty.setcbreak(keys)  # Ctrl-C still sends SIGINT
        out.write(_ENTER)
        out.flush()
        yield
    finally:
        out.write(_LEAVE)
        out.flush()
        if saved is not None and keys is not None:
            termios.tcsetattr(keys, termios.TCSADRAIN, saved)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _terminal_size(out: TextIO) -> os.terminal_size:
    """The terminal's size now (``$COLUMNS`` and ``$LINES`` go stale when it is resized)."""
    try:
        return os.get_terminal_size(out.fileno())
    except (OSError, ValueError):  # not a terminal (io.UnsupportedOperation is an OSError)
        return shutil.get_terminal_size()


def _wait_key(keys: int | None, timeout_s: float) -> str:
    if keys is None:
        time.sleep(timeout_s)  # nothing to read keys from: just refresh
        return ""
    ready, _, _ = select.select([keys], [], [], timeout_s)
    return os.read(keys, 64).decode(errors="replace") if ready else ""


def _frame(sock: str | Path, shares: ShareTracker, interval: float) -> tuple[Any, str | None]:
    try:
        status = request(sock, "status", timeout_s=max(2.0, min(interval, 10.0)))
    except DaemonUnreachable as exc:
        return None, f"kiwid unreachable: {exc}; retrying every {format_duration(interval)}"
    except ControlError as exc:
        return None, f"kiwid refused the status request: {exc.message}"
    shares.add(status, time.monotonic())
    return status, None


def run(
    sock: str | Path,
    *,
    interval: float = DEFAULT_INTERVAL_S,
    once: bool = False,
    window_s: float = DEFAULT_WINDOW_S,
    out: TextIO | None = None,
    keys: TextIO | None = None,
) -> int:
    """Run ``kiwictl top`` until ``q``, Ctrl-C, SIGTERM or SIGHUP.

    Args:
        sock: kiwid's control socket.
        interval: Seconds between frames.
        once: Print one frame (no screen control) and return.
        window_s: The window of the share column, seconds.
        out: Where frames go (default stdout).
        keys: Where keys come from (default stdin; ignored unless a terminal).

    Returns:
        0 (kiwid going away is shown and retried, not an error, except with ``once``).

    Raises:
        DaemonUnreachable: With ``once``, kiwid does not answer (kiwictl exits 3).
        ControlError: With ``once``, kiwid refused the request.
    """
    out = out or sys.stdout
    node = socketlib.gethostname()
    shares = ShareTracker(window_s)
    if once:
        status = request(sock, "status")
        shares.add(status, time.monotonic())
        width = _terminal_size(out).columns if out.isatty() else None
        out.write("\n".join(render(status, shares, node=node, width=width)) + "\n")
        return 0
    stream = keys or sys.stdin
    fd = stream.fileno() if stream.isatty() else None
    with contextlib.suppress(KeyboardInterrupt), _screen(out, fd):
        while True:
            status, error = _frame(sock, shares, interval)
            size = _terminal_size(out)
            lines = render(
                status, shares, node=node, width=size.columns, height=size.lines, error=error
            )
            out.write("\x1b[H" + "\x1b[K\n".join(lines) + "\x1b[K\x1b[J")
            out.flush()
            if "q" in _wait_key(fd, interval).lower():
                break
    return 0
