"""An inference server for bench/idle_fleet.py: real HTTP on its own port, "GPU work" per request.

Run as a script (stdlib only). It moves into its cgroups first (``--cgroup``, any
number: the cgroup2 one and the v1 freezer's), binds ``127.0.0.1`` on a free port,
prints ``ready PORT`` on stdout and serves one request at a time in its main
thread (the simulated GPU reads that thread's CPU time). Each ``GET`` does
``--work`` seconds of GPU work, then answers ``200`` with what it did.

What GPU work is depends on the card:

* ``--card sim``: CPU time, which is how the simulated GPU sees GPU activity
  (``activity = "cpu"``): a busy loop until the process used ``--work`` seconds of
  CPU. The cgroup freezer stops it where kiwid gates it.
* ``--card double``: the driver double of ``tests/stand_ins`` (its directory in
  ``KIWI_STANDIN_CUDA``). At start the server makes its CUDA context (its
  ``procs/PID`` entry with ``--memory`` bytes, as ``cuda_tenant.py`` does; it
  exits 3 when the card has no room). A request's work is CUDA calls of 5 ms:
  each waits while the double says the process is LOCKED or CHECKPOINTED (the
  driver's lock blocks CUDA calls, not the CPU), and burns 5 ms of CPU while it is
  RUNNING (the stand-in NVML samples a running process). Its memory is in host
  RAM while it is CHECKPOINTED: a restore brings it back, locked.

Not a benchmark itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

STAND_INS = Path(__file__).resolve().parents[1] / "tests" / "stand_ins"
CALL_S = 0.005
"""One CUDA call's work on the driver double."""
BLOCKED_S = 0.01
"""How often a call blocked by the lock looks again."""


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class Card:
    """Where the server's GPU work runs: the simulated GPU (CPU time) or the driver double."""

    def __init__(self, kind: str, memory: int) -> None:
        self.kind = kind
        self.memory = memory
        self.directory: Path | None = None

    def open(self) -> None:
        """Make the CUDA context on the driver double (nothing to do on the sim)."""
        if self.kind != "double":
            return
        if str(STAND_INS) not in sys.path:
            sys.path.insert(0, str(STAND_INS))
        # The stand-ins' own modules, imported as they import each other (top level).
        import cuda_tenant  # type: ignore[import-not-found]  # noqa: PLC0415
        import cudadir  # type: ignore[import-not-found]  # noqa: PLC0415

        self.directory = Path(os.environ[cudadir.ENVIRONMENT])
        cuda_tenant.create_contexts(self.directory, self.memory, {os.getpid(): {}})

    def close(self) -> None:
        """Drop the CUDA context (a SIGKILLed server leaves it; the double ignores the dead)."""
        if self.directory is None:
            return
        import cudadir  # noqa: PLC0415

        with cudadir.locked(self.directory):
            (self.directory / "procs" / str(os.getpid())).unlink(missing_ok=True)

    def work(self, seconds: float) -> tuple[float, float]:
        """Do ``seconds`` of GPU work; return (seconds of work, seconds blocked by the gate)."""
        if self.directory is None:
            start = time.process_time()
            while time.process_time() - start < seconds:
                pass
            return time.process_time() - start, 0.0
        import cudadir  # noqa: PLC0415

        done = blocked = 0.0
        me = os.getpid()
        while done < seconds:
            proc = cudadir.read_proc(self.directory, me)
            if proc is None or proc.state != cudadir.RUNNING or cudadir.lost(self.directory):
                time.sleep(BLOCKED_S)
                blocked += BLOCKED_S
                continue
            until = time.monotonic() + CALL_S
            while time.monotonic() < until:
                pass
            done += CALL_S
        return done, blocked


def serve(card: Card, work_s: float) -> None:
    """Serve HTTP on a free port of 127.0.0.1 until a signal ends the process."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            done, blocked = card.work(work_s)
            body = f"worked {done:.3f} s, blocked {blocked:.3f} s\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the bench measures from the client's side

    server = HTTPServer(("127.0.0.1", 0), Handler)
    server.request_queue_size = 64
    server.timeout = None  # block in accept: no wake-ups, no CPU time between requests
    print(f"ready {server.server_address[1]}", flush=True)
    while True:
        server.handle_request()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", choices=("sim", "double"), default="sim")
    parser.add_argument("--work", type=float, default=0.3, help="GPU work per request, s")
    parser.add_argument("--memory", type=int, default=0, help="device memory, bytes (double)")
    parser.add_argument("--cgroup", type=Path, action="append", default=[], help="move in first")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    for group in args.cgroup:
        (group / "cgroup.procs").write_text(str(os.getpid()))
    card = Card(args.card, args.memory)
    card.open()
    try:
        serve(card, args.work)
    finally:
        card.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
