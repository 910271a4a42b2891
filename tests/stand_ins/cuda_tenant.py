"""A CUDA tenant for the driver double: real processes that "use the GPU" (stdlib only).

Run as a script (``python tests/stand_ins/cuda_tenant.py --memory BYTES``) with
``KIWI_STANDIN_CUDA`` naming the double's directory. Each process of the tenant:

1. optionally moves into a cgroup first (``--cgroup``, v2), so that everything
   it starts is in it;
2. has "a context": its ``procs/PID`` entry, RUNNING, with its memory. The
   first process writes the entries of all ``--processes`` in one go (the
   driver lists them together, as a job kiwid first sees running); if their
   memory does not fit beside the resident processes and the foreign memory,
   it fails as ``cudaMalloc`` would (exit code 3, "out of memory" on stderr);
3. loops doing "GPU work": it reads its own state each iteration; while
   RUNNING (and the GPU not lost) it burns the CPU for ~5 ms and counts one
   iteration, so that the stand-in NVML's live sampling sees it run; while
   LOCKED, CHECKPOINTED or lost it sleeps 10 ms at a time (state S, no samples)
   and makes no progress. With ``--serve PORTFILE`` it works only for requests
   (:func:`serve`): it listens on TCP 127.0.0.1 (the port goes to PORTFILE) and,
   blocked in ``accept``/``recv`` in between (idle: no CPU, no samples), reads a
   request line (the iterations to do, default 20), does them in the same loop
   (so it waits the same way while LOCKED or CHECKPOINTED: a server whose first
   CUDA call blocks), then answers ``done N`` and closes the connection.

Progress goes to ``progress/PID`` in the double's directory: two little-endian
uint64 in a mapped file, the iterations done and the CLOCK_MONOTONIC time (ns)
of the last, cheap to write each iteration and to read from anywhere
(:func:`cudadir.read_progress`). A line ``ready PID`` on stdout says a process
is at work (its context may come a moment later, with the first's). On exit
(SIGTERM, SIGINT, the end of ``--seconds``) each process removes its entries; a
SIGKILLed one leaves them, and the double treats an entry whose process is gone
as no process.

``--processes N`` starts N processes (this one and N - 1 children, each with
its own context and ``--memory``); ``--spawn-later S`` starts one more S seconds
after the start, which writes its own entry, to see a gated tenant's newcomer
locked too (the first process forks it from its loop, so it comes however the
first one is gated). Children
die with the first process. ``--context-when PATH`` holds the first process's
context (and its children's) back until PATH exists: a container that makes its
first CUDA call after it was held. ``--fault N:OP:LINE`` gives process N (0 the first,
then the children as they start) a fault from its start: written with its entry,
under the card's lock, so that no one can call the driver on it before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cudadir

_PR_SET_PDEATHSIG = 1
WORK_S = 0.005
WAIT_S = 0.01


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def create_contexts(directory: Path, memory: int, processes: dict[int, dict[str, str]]) -> None:
    """Write the entries of ``processes`` (their faults by PID), RUNNING, in one go.

    One write under the card's lock, as a job whose processes are all on the card
    when kiwid first looks: whoever lists one lists them all, with their faults
    (fault-file line by call) already in place. If the memory of all does not fit
    beside what is resident, none is written: exit 3, as ``cudaMalloc`` fails.
    """
    with cudadir.locked(directory):
        config = cudadir.read_config(directory)
        used = cudadir.resident_bytes(cudadir.read_procs(directory)) + config["foreign"]
        wanted = memory * len(processes)
        if used + wanted > config["capacity"]:
            print(
                f"cuda_tenant {os.getpid()}: out of memory: {wanted} bytes do not fit "
                f"beside {used} of {config['capacity']}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(3)
        for pid, faults in processes.items():
            for op, line in faults.items():
                cudadir.write_atomic(directory / "faults" / f"{pid}.{op}", line + "\n")
            start = cudadir.start_ticks(pid) or 0
            cudadir.write_proc(directory, cudadir.Proc(pid, cudadir.RUNNING, memory, start=start))


def work(
    directory: Path,
    memory: int,
    seconds: float | None,
    create: Callable[[], None],
    on_iteration: Callable[[], None] = lambda: None,
    context_when: Path | None = None,
) -> None:
    """``create`` the context (if this process makes it), then work while RUNNING.

    ``context_when``: the context comes only once that file exists (a process that
    makes its first CUDA call late: before, the driver knows nothing of it).
    """
    pid = os.getpid()
    progress_path = directory / "progress" / str(pid)
    entry = directory / "procs" / str(pid)
    progress_path.parent.mkdir(exist_ok=True)
    try:
        while context_when is not None and not context_when.exists():
            time.sleep(WAIT_S)  # CPU work only, and none of it counted
        create()
        with open(progress_path, "w+b") as f:
            f.write(bytes(cudadir.PROGRESS.size))
            f.flush()
            counter = mmap.mmap(f.fileno(), cudadir.PROGRESS.size)
        print(f"ready {pid}", flush=True)
        end = None if seconds is None else time.monotonic() + seconds
        done = 0
        while end is None or time.monotonic() < end:
            on_iteration()
            proc = cudadir.read_proc(directory, pid)
            if proc is None or proc.state != cudadir.RUNNING or cudadir.lost(directory):
                time.sleep(WAIT_S)
                continue
            until = time.monotonic() + WORK_S
            while time.monotonic() < until:
                pass
            done += 1
            cudadir.PROGRESS.pack_into(counter, 0, done, time.monotonic_ns())
    finally:
        with cudadir.locked(directory):
            entry.unlink(missing_ok=True)
        progress_path.unlink(missing_ok=True)


def serve(port_file: Path, directory: Path) -> Callable[[], None]:
    """The ``on_iteration`` of :func:`work` for a server (``--serve``): work per request.

    At its first call it listens and writes the port to ``port_file``. Each call
    returns at once while the request at hand still has iterations to do (the loop
    does them, or waits while gated); once they are done it answers, then blocks
    until the next request has been read. Only the first process serves.
    """
    pid = os.getpid()
    listener: socket.socket | None = None
    client: socket.socket | None = None
    asked = target = 0

    def on_iteration() -> None:
        nonlocal listener, client, asked, target
        if listener is None:
            listener = socket.create_server(("127.0.0.1", 0))
            cudadir.write_atomic(port_file, f"{listener.getsockname()[1]}\n")
        done = cudadir.read_progress(directory, pid)[0]
        if client is not None:
            if done < target:
                return
            with client:
                client.sendall(f"done {asked}\n".encode())
            client = None
        while client is None:  # a client that hangs up before its request is dropped
            client, _ = listener.accept()
            with client.makefile("rb") as reader:
                line = reader.readline(64).strip()
            if not line:
                client.close()
                client = None
        asked = int(line) if line.isdigit() else 20
        target = done + asked

    return on_iteration


def spawn(directory: Path, memory: int, seconds: float | None, create: Callable[[], None]) -> int:
    """Fork a process that works until the first one dies (or the end); return its PID."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            work(directory, memory, seconds, create)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            os._exit(code)  # never back into the parent's frames
    return pid


def main(argv: list[str] | None = None) -> int:
    """Run the tenant (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", type=int, required=True, help="device memory, bytes")
    parser.add_argument("--processes", type=int, default=1, help="processes with a context")
    parser.add_argument("--spawn-later", type=float, help="start one more after SECONDS")
    parser.add_argument("--seconds", type=float, help="stop after SECONDS (default: never)")
    parser.add_argument("--cgroup", type=Path, help="a v2 cgroup to move into first")
    parser.add_argument(
        "--context-when",
        type=Path,
        metavar="PATH",
        help="create the CUDA context(s) only once PATH exists (a first CUDA call, late)",
    )
    parser.add_argument(
        "--serve",
        type=Path,
        metavar="PORTFILE",
        help="work only for requests on a TCP port of 127.0.0.1, written to PORTFILE",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="N:OP:LINE",
        help="process N (0 this one, then the children as they start) has LINE in its "
        "fault file for OP from its start, e.g. '1:checkpoint:fail 2 100'",
    )
    args = parser.parse_args(argv)
    if args.memory < 0 or args.processes < 1:
        parser.error("--memory must be >= 0 and --processes >= 1")
    if args.serve is not None and (args.seconds is not None or args.spawn_later is not None):
        parser.error("--serve waits for requests: not with --seconds or --spawn-later")
    faults: dict[int, dict[str, str]] = {}
    for spec in args.fault:
        index, op, line = [*spec.split(":", 2), "", ""][:3]
        if not index.isdigit() or op not in cudadir.OPS or not line:
            parser.error(f"--fault {spec!r}: expected N:OP:LINE with OP one of {cudadir.OPS}")
        faults.setdefault(int(index), {})[op] = line
    directory = Path(os.environ.get(cudadir.ENVIRONMENT, ""))
    if not (directory / "config").is_file():
        parser.error(f"{cudadir.ENVIRONMENT} must name the double's directory")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.cgroup is not None:
        (args.cgroup / "cgroup.procs").write_text(str(os.getpid()))
    children = [
        spawn(directory, args.memory, args.seconds, lambda: None)  # created below
        for _ in range(1, args.processes)
    ]
    at_start = {os.getpid(): faults.get(0, {})}
    at_start |= {child: faults.get(n, {}) for n, child in enumerate(children, 1)}
    later = None if args.spawn_later is None else time.monotonic() + args.spawn_later

    def maybe_spawn() -> None:
        nonlocal later
        if later is not None and time.monotonic() >= later:
            later = None
            own = faults.get(len(children) + 1, {})
            children.append(
                spawn(
                    directory,
                    args.memory,
                    args.seconds,
                    lambda: create_contexts(directory, args.memory, {os.getpid(): own}),
                )
            )

    try:
        work(
            directory,
            args.memory,
            args.seconds,
            lambda: create_contexts(directory, args.memory, at_start),
            maybe_spawn if args.serve is None else serve(args.serve, directory),
            args.context_when,
        )
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
