"""kiwi-hook and a pod's GPU memory declaration (``kiwi.io/gpu-memory``).

The one thing that fails a container's start: a declaration that is no memory size,
or one kiwid refuses because no GPU of the container could ever hold it. Anything
else about kiwid (down, hung, another refusal) still lets it start ungated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kiwid.hook.main import container_info
from tests.hook.test_hook import CID, FakeKiwid, make_bundle, run_hook

Gi = 2**30


@pytest.fixture
def fake_kiwid(tmp_path: Path) -> Iterator[FakeKiwid]:
    kiwid = FakeKiwid(tmp_path / "kiwid.sock")
    yield kiwid
    kiwid.close()


def state_with(tmp_path: Path, memory: str | None) -> dict[str, object]:
    annotations = {} if memory is None else {"kiwi.io/gpu-memory": memory}
    bundle = make_bundle(tmp_path, cgroups_path="/k/c")
    return {"id": CID, "bundle": str(bundle), "annotations": annotations}


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [("40Gi", 40 * Gi), ("512Mi", 512 * 2**20), ("1G", 10**9), ("1073741824", Gi)],
)
def test_the_declaration_goes_into_register_as_bytes_from_its_annotation(
    tmp_path: Path, value: str, nbytes: int
) -> None:
    info = container_info(state_with(tmp_path, value), proc=tmp_path / "no-proc")
    assert (info.memory, info.refusal, info.problems) == (nbytes, None, ())
    args = info.register_args(hold=True)
    assert (args["memory_bytes"], args["memory_source"]) == (nbytes, "annotation")
    bare = container_info(state_with(tmp_path, None), proc=tmp_path / "no-proc")
    assert "memory_bytes" not in bare.register_args(hold=True)
    assert "memory_source" not in bare.register_args(hold=True)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("40GB", "it is no Kubernetes quantity"),
        ("40 Gi", "it is no Kubernetes quantity"),
        ("", "it is empty"),
        ("0", "it must be more than 0 bytes"),
        ("-1Gi", "it must be more than 0 bytes"),
        ("1K", "its suffix 'K' is none of"),
    ],
)
def test_a_declaration_that_is_no_size_fails_the_start_naming_it(
    tmp_path: Path, fake_kiwid: FakeKiwid, value: str, why: str
) -> None:
    fake_kiwid.serve()
    out, _ = run_hook("--socket", str(fake_kiwid.path), "create", state=state_with(tmp_path, value))
    assert out.returncode == 1, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"kiwi-hook: error: container {CID}: annotation kiwi.io/gpu-memory=")
    assert f"kiwi.io/gpu-memory={value!r} must be a GPU memory size" in line
    assert why in line and line.endswith("; the container does not start")
    assert fake_kiwid.requests == []  # kiwid is not even asked


def test_a_declaration_kiwid_refuses_fails_the_start_with_kiwids_words(
    tmp_path: Path, fake_kiwid: FakeKiwid
) -> None:
    words = (
        "container c0 declares 200 GiB of GPU memory per GPU (its pod's annotation "
        "kiwi.io/gpu-memory), more than GPU 0 can ever give it"
    )
    error = {"code": "invalid-value", "message": words, "arg": "memory_bytes"}
    fake_kiwid.reply = {"ok": False, "error": error}
    fake_kiwid.serve()
    out, _ = run_hook(
        "--socket", str(fake_kiwid.path), "create", state=state_with(tmp_path, "200Gi")
    )
    assert out.returncode == 1
    assert out.stderr == (
        f"kiwi-hook: error: {words} (kiwid refused it); the container does not start\n"
    )
    (register,) = fake_kiwid.requests
    assert register["args"]["memory_bytes"] == 200 * Gi


def test_other_refusals_and_an_absent_kiwid_still_let_it_start(
    tmp_path: Path, fake_kiwid: FakeKiwid
) -> None:
    error = {"code": "invalid-value", "message": "no GPU '9' on this node"}  # no arg
    fake_kiwid.reply = {"ok": False, "error": error}
    fake_kiwid.serve()
    state = state_with(tmp_path, "40Gi")
    out, _ = run_hook("--socket", str(fake_kiwid.path), "create", state=state)
    assert out.returncode == 0 and "warning" in out.stderr
    out, _ = run_hook("--socket", str(tmp_path / "nobody.sock"), "create", state=state)
    assert out.returncode == 0 and "it runs ungated" in out.stderr
