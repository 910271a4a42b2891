"""``kiwictl``: change and inspect a running kiwid over its control socket."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from kiwid.adapters.control import ControlError, DaemonUnreachable, request
from kiwid.cli import explain, mending, top
from kiwid.cli.lookup import find_or_say
from kiwid.cli.status_text import format_number, format_status, format_tenants
from kiwid.cli.workloads_text import format_workloads
from kiwid.core.model import TenantPolicy

DEFAULT_SOCKET = "/run/kiwi/kiwid.sock"
EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_FORBIDDEN = 4

_DESCRIPTION = """\
Change and inspect the Kiwi GPU scheduler (kiwid) on this machine.

Kiwi gives each container exclusive use of a GPU for TQ seconds at a time and
rotates round-robin between those that want it. Runtime changes made here last
until kiwid reloads or restarts; /etc/kiwi.toml is the persistent setting."""

_EPILOG = """\
examples:
  kiwictl -T 20               set the time quantum of every GPU to 20 seconds
  kiwictl -T 60 --gpu 1       only GPU 1 (an index or a UUID)
  kiwictl -S off              stop gating: the driver time-slices the GPUs
  kiwictl -S on               back to the configured mode
  kiwictl status              who holds each GPU, who waits and since when
  kiwictl status --json       the same, as stable JSON for scripts
  kiwictl tenants             every process or container kiwid knows
  kiwictl top                 live view of every GPU: holder, queue, shares (q quits)
  kiwictl explain 4f2a        why that tenant waits or idles (id, container id, pod or PID)
  kiwictl workloads           what kiwid remembers of each workload's earlier runs
  kiwictl forget 'unit train.service'
                              forget one: its next run is a newcomer again
  kiwictl retry 4f2a          a STUCK tenant (a driver call failed or hung on it):
                              try again; it then waits for its turn
  kiwictl release 4f2a        or let it run ungated, outside the rotation, on your
                              word (until it leaves, or you retry it)
  kiwictl wake notebook-7     a PARKED tenant (idle, its memory in host RAM) joins
                              the queue now, before its next request arrives

A tenant is stuck when an operation on it failed for good, ran past
gpu.driver_timeout, or left the driver out of step: it stays gated and holds
nothing while the others rotate (kiwictl status and explain say why). A tenant
is parked when it was idle as its memory went to host RAM, or did no GPU work in
a turn: it holds no turns until a request waits on one of its sockets or
kiwictl wake wakes it.

Changing the scheduler (-T, -S, set-weight, set-priority, forget, retry,
release) needs root or membership of the admin group (admin_group in
/etc/kiwi.toml, default "kiwi"); wake needs that or to be the user the tenant's
processes run as; status, tenants and workloads are open to every local user.

exit status:
  0  success
  1  the request was invalid (refused by kiwictl or by kiwid), or did not take
     (a retry or release that left the tenant stuck)
  2  usage error
  3  kiwid is unreachable (not running, or no access to the socket)
  4  permission denied"""


def _add_socket(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=default,
        help=f"kiwid's control socket (default: $KIWI_SOCKET or {DEFAULT_SOCKET})",
    )


def build_parser() -> argparse.ArgumentParser:
    """Build the ``kiwictl`` argument parser.

    Returns:
        The parser; ``command`` is ``None`` unless a command (``status``, ``top``…) is given.
    """
    parser = argparse.ArgumentParser(
        prog="kiwictl",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_socket(parser, os.environ.get("KIWI_SOCKET") or DEFAULT_SOCKET)
    parser.add_argument(
        "-T",
        "--tq",
        metavar="SECONDS",
        help="set the time quantum: how long a tenant keeps a GPU while others wait",
    )
    parser.add_argument("--gpu", metavar="ID", help="with -T: only this GPU (index or UUID)")
    parser.add_argument(
        "-S",
        "--scheduler",
        choices=["on", "off"],
        help="off: no gating, the driver time-slices; on: back to the configured mode",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in (
        ("status", "show who holds each GPU, who waits, and the settings in force"),
        ("tenants", "list the tenants (processes or containers) kiwid knows"),
        (
            "workloads",
            "list the workloads kiwid remembers from earlier runs: the peak GPU memory "
            "it sizes their next run by, when each was last seen, and whether a failed "
            "checkpoint keeps it on the card (why, and until when)",
        ),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        _add_socket(cmd, argparse.SUPPRESS)  # accepted after the command too
        cmd.add_argument("--json", action="store_true", help="print the daemon's JSON as is")
    _add_top(sub)
    _add_explain(sub)
    _add_forget(sub)
    for name, text in mending.HELP.items():
        cmd = sub.add_parser(name, help=text, description=text)
        _add_socket(cmd, argparse.SUPPRESS)
        cmd.add_argument(
            "tenant",
            metavar="TENANT",
            help="tenant id, container id (4+ characters), name, pod or PID",
        )
    _add_wake(sub)
    for name, what, kind in (
        ("set-weight", f"weight: its quantum is TQ x weight ({TenantPolicy.WEIGHT_RANGE})", float),
        (
            "set-priority",
            f"priority: higher first, preempting lower holders ({TenantPolicy.PRIORITY_RANGE})",
            int,
        ),
    ):
        text = (
            f"set a tenant's {what}, until the next reload or restart (not persisted: "
            "/etc/kiwi.toml [[tenants]] rules are)"
        )
        cmd = sub.add_parser(name, help=text, description=text)
        _add_socket(cmd, argparse.SUPPRESS)
        cmd.add_argument(
            "tenant",
            metavar="TENANT",
            help="tenant id, container id (4+ characters), name, pod or PID",
        )
        cmd.add_argument("value", metavar="N", type=kind, help=f"the new {name.split('-')[1]}")
    return parser


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number greater than 0, not {text!r}")
    return value


def _add_top(sub: Any) -> None:
    text = "live view of every GPU: holder, queue with ETAs, shares of GPU time (q quits)"
    cmd = sub.add_parser("top", help=text, description=text)
    _add_socket(cmd, argparse.SUPPRESS)
    cmd.add_argument(
        "--interval",
        type=_positive,
        default=top.DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help=f"seconds between refreshes (default {top.DEFAULT_INTERVAL_S:g})",
    )
    cmd.add_argument(
        "--window",
        type=_positive,
        default=top.DEFAULT_WINDOW_S / 60,
        metavar="MINUTES",
        help=f"share of GPU time over the last MINUTES (default {top.DEFAULT_WINDOW_S / 60:g})",
    )
    cmd.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")


def _add_forget(sub: Any) -> None:
    text = (
        "forget one remembered workload now (its footprint and any failed-checkpoint "
        "mark): its next run is a newcomer again, and may be swapped. Tenants running "
        "it now keep what they were told; their runs are remembered anew when they end"
    )
    cmd = sub.add_parser("forget", help=text, description=text)
    _add_socket(cmd, argparse.SUPPRESS)
    cmd.add_argument("workload", metavar="WORKLOAD", help="its name as kiwictl workloads lists it")


def _add_wake(sub: Any) -> None:
    text = (
        "wake a parked tenant (idle, its memory in host RAM): it joins the queue as a "
        "burst and is restored at its turn, as a request to it would; a gateway may call "
        "this when a request for the tenant is on its way. A tenant that is not parked "
        "is left as it is"
    )
    cmd = sub.add_parser("wake", help=text, description=text)
    _add_socket(cmd, argparse.SUPPRESS)
    cmd.add_argument(
        "tenant",
        metavar="TENANT",
        help="tenant id, container id (4+ characters), name, pod or PID",
    )


def _wake(path: str, query: str) -> int:
    """``kiwictl wake TENANT``: find the tenant, ask kiwid to wake it, say what happened."""
    tenant = find_or_say(request(path, "status"), query)
    if tenant is None:
        return EXIT_INVALID
    result = request(path, "wake", {"tenant": str(tenant["id"])})
    if result.get("woken"):
        print(f"[INFO] Woke {result['tenant']}: it is {result['state']}, queued for its turn.")
    else:
        print(f"[INFO] {result['tenant']} is not parked ({result['state']}): nothing to wake.")
    return EXIT_OK


def _add_explain(sub: Any) -> None:
    text = "say in plain words why a tenant waits, idles or is stuck, who is ahead, and its ledger"
    cmd = sub.add_parser("explain", help=text, description=text)
    _add_socket(cmd, argparse.SUPPRESS)
    cmd.add_argument(
        "tenant",
        metavar="TENANT",
        help="tenant id, container id (4+ leading characters), name, pod or PID",
    )
    cmd.add_argument("--json", action="store_true", help="print the facts as JSON")


def parse_tq(text: str) -> float:
    """Check a TQ given on the command line.

    Args:
        text: What the user typed after ``-T``.

    Returns:
        The TQ in seconds.

    Raises:
        ValueError: Not a finite number greater than zero; the message says so.
    """
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"TQ must be a number of seconds, not {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"TQ must be a finite number of seconds greater than 0, not {text!r}")
    return value


def _run(args: argparse.Namespace) -> int:
    path = args.socket
    if args.command == "top":
        return top.run(path, interval=args.interval, once=args.once, window_s=args.window * 60)
    if args.command == "explain":
        return explain.run(path, args.tenant, as_json=args.json)
    if args.command in mending.HELP:
        return mending.run(path, args.command, args.tenant)
    if args.command == "wake":
        return _wake(path, args.tenant)
    if args.command in ("set-weight", "set-priority"):
        return _set_policy(path, args.command, args.tenant, args.value)
    if args.command == "forget":
        result = request(path, "forget-workload", {"workload": args.workload})
        print(f"[INFO] Forgot workload {result['forgotten']!r}: its next run is a newcomer.")
        if not result.get("saved", True):
            print(
                "[WARNING] kiwid could not save its workloads file (its log says why): "
                "the workload is forgotten until kiwid restarts",
                file=sys.stderr,
            )
        return EXIT_OK
    if args.command is not None:
        result = request(path, args.command)
        if args.json:
            print(json.dumps(result, indent=2, sort_keys=True))
        elif args.command == "status":
            print(format_status(result))
        elif args.command == "workloads":
            print(format_workloads(result))
        else:
            print(format_tenants(result.get("tenants") or []))
        return EXIT_OK
    if args.tq is not None:
        try:
            tq = parse_tq(args.tq)
        except ValueError as exc:
            print(f"[ERROR] {exc}", file=sys.stderr)
            return EXIT_INVALID
        tq_args: dict[str, Any] = {"tq": tq} if args.gpu is None else {"tq": tq, "gpu": args.gpu}
        result = request(path, "set-tq", tq_args)
        print(f"[INFO] Successfully set the scheduler TQ to {format_number(result['tq'])} seconds.")
        if result.get("warning"):
            print(f"[WARNING] {result['warning']}", file=sys.stderr)
        return EXIT_OK
    result = request(path, "set-mode", {"mode": args.scheduler})
    if result["mode"] == "off":
        print(
            "[INFO] Anti-thrashing scheduler is now off "
            "(no gating: the driver time-slices the GPU)."
        )
    else:
        print(f"[INFO] Anti-thrashing scheduler is now on (mode {result['mode']}).")
    return EXIT_OK


def _set_policy(path: str, command: str, query: str, value: float) -> int:
    """``kiwictl set-weight|set-priority TENANT N``: find the tenant, then ask kiwid."""
    tenant = find_or_say(request(path, "status"), query)
    if tenant is None:
        return EXIT_INVALID
    field = command.removeprefix("set-")
    result = request(path, command, {"tenant": str(tenant["id"]), field: value})
    policy = result.get("policy") or {}
    print(
        f"[INFO] {result.get('tenant')}: {field} {format_number(float(value))} until the next "
        f"reload or restart (weight {format_number(float(policy.get('weight', 1)))}, "
        f"priority {policy.get('priority', 0)})."
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kiwictl``.

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 1 invalid request, 2 usage error, 3 kiwid
        unreachable, 4 permission denied.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        actions = [args.command is not None, args.tq is not None, args.scheduler is not None]
        if sum(actions) != 1:
            parser.error("give exactly one of -T SECONDS, -S on|off or a command")
        if args.gpu is not None and args.tq is None:
            parser.error("--gpu only goes with -T")
    except SystemExit as exc:  # argparse's way of reporting usage errors and --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return _run(args)
    except DaemonUnreachable as exc:
        print(f"[ERROR] {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ControlError as exc:
        print(f"[ERROR] {exc.message}", file=sys.stderr)
        return EXIT_FORBIDDEN if exc.code == "forbidden" else EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
