"""Benchmark: control-socket round trips against a real kiwid (1 simulated GPU).

Phase 1: 100 concurrent clients, each on its own connection, each sending 50
requests one after the other (``status`` and ``ping`` alternating): round-trip
p50/p90/p99/max and the total requests per second. Target: p99 < 5 ms. Then the
same with 10 clients, for context. Phase 2: one client alone on one connection
(the service time, without queueing). Phase 3: one connection per request
(connect, request, close), as kiwictl does. Prints the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from _kiwid import (
    GIB,
    Kiwid,
    Tenants,
    cpu_seconds,
    exit_on_sigterm,
    machine,
    percentiles,
    raise_nofile,
)

from kiwid.adapters.control import request

TARGET_P99_MS = 5.0
CMDS = ("status", "ping")


def _line(cmd: str, rid: int) -> bytes:
    return json.dumps({"v": 1, "id": rid, "cmd": cmd, "args": {}}).encode() + b"\n"


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("kiwid closed the connection")
    return chunk


class Client(threading.Thread):
    """One connection; sends its requests one after the other, timing each."""

    def __init__(
        self, sock_path: str, count: int, start: threading.Barrier, pace_s: float = 0.0
    ) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30.0)
        self.sock.connect(sock_path)
        self.count = count
        self.start_barrier = start
        self.pace_s = pace_s
        self.samples: list[tuple[str, float]] = []
        self.replies: list[bytes] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.start_barrier.wait()
            buf = b""
            # Paced clients start at random offsets, as independent pollers would.
            next_at = time.perf_counter() + random.uniform(0, self.pace_s)
            for i in range(self.count):
                if self.pace_s:
                    time.sleep(max(0.0, next_at - time.perf_counter()))
                    next_at += self.pace_s
                cmd = CMDS[i % len(CMDS)]
                payload = _line(cmd, i)
                t0 = time.perf_counter()
                self.sock.sendall(payload)
                while b"\n" not in buf:
                    buf += _recv(self.sock)
                t1 = time.perf_counter()
                reply, _, buf = buf.partition(b"\n")
                self.samples.append((cmd, (t1 - t0) * 1000))
                self.replies.append(reply)
        except BaseException as exc:
            self.error = exc
        finally:
            self.sock.close()


def _check(replies: Sequence[bytes]) -> None:
    for raw in replies:
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise RuntimeError(f"kiwid refused a request: {reply}")


def _fmt(ms: Sequence[float], qs: tuple[float, ...] = (50, 90, 99, 100)) -> str:
    names = {50: "p50", 90: "p90", 99: "p99", 100: "max"}
    return "  ".join(
        f"{names[q]} {v:.2f}" for q, v in zip(qs, percentiles(list(ms), qs), strict=True)
    )


def concurrent(
    sock: str, clients: int, per_client: int, kiwid_pid: int, pace_s: float = 0.0
) -> None:
    barrier = threading.Barrier(clients + 1)
    threads = [Client(sock, per_client, barrier, pace_s) for _ in range(clients)]
    for t in threads:
        t.start()
    cpu0 = (cpu_seconds(kiwid_pid), cpu_seconds())
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    kiwid_cpu, own_cpu = (cpu_seconds(kiwid_pid) - cpu0[0], cpu_seconds() - cpu0[1])
    for t in threads:
        if t.error is not None:
            raise RuntimeError(f"a client failed: {t.error!r}")
        _check(t.replies)
    samples = [s for t in threads for s in t.samples]
    all_ms = [ms for _, ms in samples]
    p99 = percentiles(all_ms, (99,))[0]
    verdict = "met" if p99 < TARGET_P99_MS else "MISSED"
    how = f"each one request every {pace_s * 1000:g} ms" if pace_s else "back to back"
    print(
        f"persistent connections, {clients} concurrent clients x {per_client} requests, "
        f"{how} (status/ping alternating): {len(samples)} requests in {elapsed:.2f} s "
        f"= {len(samples) / elapsed:,.0f} requests/s"
    )
    print(f"  round trip ms: {_fmt(all_ms)}  (target p99 < {TARGET_P99_MS:g} ms: {verdict})")
    for cmd in CMDS:
        print(f"  {cmd:<6} ms: {_fmt([ms for c, ms in samples if c == cmd])}")
    print(
        f"  CPU during the phase: kiwid {100 * kiwid_cpu / elapsed:.0f}% of a core "
        f"({1e6 * kiwid_cpu / len(samples):.0f} us per request), "
        f"benchmark clients {100 * own_cpu / elapsed:.0f}%"
    )


def single(sock: str, count: int, *, quiet: bool = False) -> None:
    barrier = threading.Barrier(1)
    client = Client(sock, count, barrier)
    client.run()  # in this thread
    if client.error is not None:
        raise RuntimeError(f"the client failed: {client.error!r}")
    _check(client.replies)
    if quiet:
        return
    print(f"persistent connection, 1 client x {count} requests (no queueing):")
    for cmd in CMDS:
        print(f"  {cmd:<6} ms: {_fmt([ms for c, ms in client.samples if c == cmd])}")


def per_request(sock: str, count: int) -> None:
    samples: list[tuple[str, float]] = []
    for i in range(count):
        cmd = CMDS[i % len(CMDS)]
        t0 = time.perf_counter()
        request(sock, cmd)
        samples.append((cmd, (time.perf_counter() - t0) * 1000))
    print(f"one connection per request (connect, request, close; as kiwictl), 1 client x {count}:")
    for cmd in CMDS:
        ms = [m for c, m in samples if c == cmd]
        print(f"  {cmd:<6} ms: {_fmt(ms, (50, 99, 100))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--requests", type=int, default=50, help="per client")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument(
        "--profile", type=Path, help="run kiwid under cProfile, write its profile here"
    )
    args = parser.parse_args()
    exit_on_sigterm()
    raise_nofile(4 * args.clients + 256)
    print(machine())
    with Tenants() as tenants, Kiwid(devices=1, profile=args.profile) as kiwid:
        for _ in range(args.tenants):
            pid = tenants.spawn()
            attach = {"pid": pid, "gpu": 0, "memory_bytes": GIB, "activity": "cpu"}
            kiwid.request("sim-attach", attach)
        deadline = time.monotonic() + 10
        while len(kiwid.request("tenants")["tenants"]) < args.tenants:  # type: ignore[arg-type]
            if time.monotonic() > deadline:
                raise RuntimeError("kiwid did not see the tenants")
            time.sleep(0.1)
        print(f"kiwid: 1 simulated GPU, {args.tenants} idle tenants, poll every 0.5 s")
        sock = str(kiwid.sock)
        single(sock, 200, quiet=True)  # warm-up
        concurrent(sock, args.clients, args.requests, kiwid.pid)
        # The same clients as pollers (each a request every 100 ms: 1,000 requests/s in
        # all), rather than a saturating closed loop.
        concurrent(sock, args.clients, args.requests, kiwid.pid, pace_s=0.1)
        if args.clients > 10:
            concurrent(sock, 10, args.requests, kiwid.pid)  # context: a lighter load
        single(sock, 1000)
        per_request(sock, 1000)


if __name__ == "__main__":
    main()
