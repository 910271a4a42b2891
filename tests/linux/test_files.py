from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kiwid.linux import files
from kiwid.linux.files import NotRegularFile, TooLarge, read_regular


def test_reads_a_regular_file_and_a_symlink_to_one(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_bytes(b"x = 1\n")
    (tmp_path / "link").symlink_to(path)
    assert read_regular(path, 6) == b"x = 1\n"
    assert read_regular(str(tmp_path / "link"), 100) == b"x = 1\n"
    (tmp_path / "empty").touch()
    assert read_regular(tmp_path / "empty", 0) == b""


@pytest.fixture
def never_opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the paths read_regular opens: a special file must not even be opened."""
    opened: list[str] = []
    real_open = os.open

    def spy(path: str | Path, flags: int, *args: int) -> int:
        opened.append(str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(files.os, "open", spy)
    return opened


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("fifo", "a FIFO (named pipe)"),
        ("/dev/zero", "a character device"),
        ("link-to-device", "a character device"),  # opening some (/dev/watchdog) acts
        ("dir", "a directory"),
        ("link-to-fifo", "a FIFO (named pipe)"),
    ],
)
def test_refuses_special_files_without_opening_them(
    tmp_path: Path, never_opened: list[str], name: str, kind: str
) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link-to-fifo").symlink_to(tmp_path / "fifo")
    (tmp_path / "link-to-device").symlink_to("/dev/null")
    path = tmp_path / name
    with pytest.raises(NotRegularFile) as info:
        read_regular(path, 1 << 20)
    assert str(info.value) == f"{path} is {kind}, not a regular file"
    assert (info.value.path, info.value.kind) == (str(path), kind)
    assert never_opened == []


def test_a_file_swapped_after_the_check_is_caught_on_the_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    regular = tmp_path / "regular"
    regular.touch()
    os.mkfifo(tmp_path / "fifo")
    checked = regular.stat()
    monkeypatch.setattr(files.Path, "stat", lambda *_, **__: checked)  # checked, then swapped
    with pytest.raises(NotRegularFile, match="is a FIFO"):
        read_regular(tmp_path / "fifo", 100)


def test_refuses_large_files_and_files_that_grow(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * 101)
    with pytest.raises(TooLarge) as info:
        read_regular(path, 100)
    assert str(info.value) == f"{path} is larger than 100 bytes"
    assert (info.value.path, info.value.max_bytes) == (str(path), 100)
    assert read_regular(path, 101) == b"x" * 101
    # /proc files say they hold 0 bytes and then hold more: the read itself is bounded.
    with pytest.raises(TooLarge, match="larger than 10 bytes"):
        read_regular("/proc/self/status", 10)


def test_other_errors_are_the_os_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 10)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OSError) as info:
        read_regular(loop, 10)
    assert info.value.errno == errno.ELOOP
    (tmp_path / "file").touch()
    with pytest.raises(NotADirectoryError):
        read_regular(tmp_path / "file" / "below", 10)
