"""/proc readers: a process's command line, program and mapped files."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

from kiwid.linux import proc

MAPS = """\
55d4c0a00000-55d4c0a2a000 r--p 00000000 08:01 1048612    /usr/bin/python3.11
7f0e1c000000-7f0e1c021000 rw-p 00000000 00:00 0
7f0e1d200000-7f0e1d400000 rw-s 00000000 00:1a 4242       /dev/shm/nccl-AbC123
7f0e1e000000-7f0e1e100000 r-xp 00000000 08:01 2097   /opt/lib/libnccl.so.2.21.5
7f0e1f000000-7f0e1f001000 rw-p 00000000 00:00 0          [heap]
7f0e20000000-7f0e20001000 rw-s 00000000 00:01 77         /memfd:cuda (deleted)
7f0e21000000-7f0e21001000 r--p 00000000 08:01 99         /tmp/a file with spaces
"""


def test_parse_maps_keeps_paths_only() -> None:
    assert proc.parse_maps(MAPS) == {
        "/usr/bin/python3.11",
        "/dev/shm/nccl-AbC123",
        "/opt/lib/libnccl.so.2.21.5",
        "/memfd:cuda (deleted)",
        "/tmp/a file with spaces",
    }


def test_a_live_process_shows_its_command_line_program_and_mappings(tmp_path: Path) -> None:
    mapped = tmp_path / "mapped file"
    mapped.write_bytes(b"x" * mmap.PAGESIZE)
    code = (
        "import mmap, sys\n"
        "f = open(sys.argv[1], 'r+b')\n"
        "m = mmap.mmap(f.fileno(), 0)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, str(mapped), "arg two"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as child:
        _check_live(child, code, mapped)
    assert proc.command_line(child.pid) is None
    assert proc.executable(child.pid) is None
    assert proc.mapped_files(child.pid) is None


def _check_live(child: subprocess.Popen[bytes], code: str, mapped: Path) -> None:
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        assert proc.command_line(child.pid) == (sys.executable, "-c", code, str(mapped), "arg two")
        assert proc.executable(child.pid) == str(Path(sys.executable).resolve())
        files = proc.mapped_files(child.pid)
        assert files is not None and str(mapped) in files
    finally:
        child.kill()
        child.wait()


def test_a_kernel_thread_has_no_command_line() -> None:
    assert proc.command_line(2) is None  # kthreadd


def test_maps_longer_than_one_read_are_read_whole(tmp_path: Path) -> None:
    # ~1200 mappings of ~110 bytes each: well over the 64 KiB of a single read.
    names = [tmp_path / f"mapped-{i:04d}-{'x' * 40}" for i in range(1200)]
    for path in names:
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    # A mapping outlives its file's descriptor, but CPython's mmap.mmap keeps a dup()
    # of it: 1200 of those would pass Debian's stock limit of 1024 open files. libc's
    # mmap keeps none, and each file is closed once mapped.
    code = (
        "import ctypes, mmap, os, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,\n"
        "                      ctypes.c_int, ctypes.c_int, ctypes.c_long)\n"
        "for p in sys.argv[1:]:\n"
        "    fd = os.open(p, os.O_RDONLY)\n"
        "    at = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)\n"
        "    os.close(fd)\n"
        "    if at == ctypes.c_void_p(-1).value:\n"
        "        raise OSError(ctypes.get_errno(), f'mmap {p}')\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, *map(str, names)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"ready\n"
            assert len(Path(f"/proc/{child.pid}/maps").read_bytes()) > 65536
            files = proc.mapped_files(child.pid)
            assert files is not None and {str(p) for p in names} <= files
        finally:
            child.kill()
            child.wait()
