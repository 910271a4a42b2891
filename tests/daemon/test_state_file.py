"""The state file: reads never wait behind a write and its fsync."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kiwid.daemon.gating import state as state_module
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile


def record(tenant: str) -> GatedRecord:
    return GatedRecord(tenant, "freeze", f"/kiwi-test/{tenant}", None, (123,), starts=(456,))


def test_reading_the_records_never_waits_behind_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateFile(tmp_path / "state")
    state.put(record("a"))
    in_fsync, release = threading.Event(), threading.Event()
    real_write = state_module.write_atomic

    def held_write(path: Any, data: bytes, *args: Any, **kwargs: Any) -> None:
        in_fsync.set()  # the writer is where fsync would hold it
        assert release.wait(20), "the test never let the write go"
        real_write(path, data, *args, **kwargs)

    monkeypatch.setattr(state_module, "write_atomic", held_write)
    writer = threading.Thread(target=state.put, args=(record("b"),))
    writer.start()
    try:
        assert in_fsync.wait(10), "the writer never reached its write"
        seen: list[set[str]] = []
        reader = threading.Thread(target=lambda: seen.append(set(state.records)))
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "a read waited behind the write"
        assert seen == [{"a"}]  # what was last written; b is not durable yet
    finally:
        release.set()
        writer.join(10)
    assert set(state.records) == {"a", "b"}
    assert set(StateFile(tmp_path / "state").load()) == {"a", "b"}


def test_a_write_that_fails_leaves_the_records_as_the_file_has_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateFile(tmp_path / "state")
    state.put(record("a"))

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_module, "write_atomic", full_disk)
    with pytest.raises(OSError, match="No space"):
        state.put(record("b"))
    with pytest.raises(OSError, match="No space"):
        state.drop("a")
    assert set(state.records) == {"a"}


def test_tidying_an_empty_state_keeps_a_record_written_since_the_caller_looked(
    tmp_path: Path,
) -> None:
    """At start-up re-adoption saw no records and tidied the file away while the first
    poll's gate job recorded its tenant: the record went, and the tenant stayed frozen
    with nothing to let it go (its ungate found no record)."""
    state = StateFile(tmp_path / "state")
    assert not state.records  # what the tidying caller saw
    state.put(record("b"))  # a gate job on its thread, meanwhile
    assert not state.remove_if_empty()
    assert set(state.records) == {"b"}
    assert set(StateFile(tmp_path / "state").load()) == {"b"}
    state.drop("b")
    assert state.remove_if_empty()
    assert not state.path.exists()


def test_a_job_replaces_or_drops_only_the_version_it_read(tmp_path: Path) -> None:
    """A job whose record changed since it read it (fenced beside its hung call) must
    neither overwrite nor drop what was written after: every write bumps a version,
    also one that writes the same record again (no ABA)."""
    state = StateFile(tmp_path / "state")
    read = state.put(record("a"))
    assert read is not None and read.version == 1
    fenced = GatedRecord("a", "cuda-lock", "/kiwi-test/a", None, (123,), fenced=True)
    state.put(fenced)  # written meanwhile
    assert not state.drop("a", expect=read.version)
    assert state.put(record("a"), expect=read.version) is None
    assert state.records["a"].fenced
    again = state.put(record("a"), expect=2)  # the same content as first read: version 3
    assert again is not None and again.version == 3
    assert not state.drop("a", expect=read.version)
    assert state.drop("a", expect=3)
    assert not state.records
    assert StateFile(tmp_path / "state").load() == {}
