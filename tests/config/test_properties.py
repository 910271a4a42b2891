"""Properties: whatever the document or the path, the loader answers with a ConfigError.

``parse_config`` gets TOML documents built from the known tables and keys (and
some unknown ones) holding values of every TOML type; ``check_config_main`` gets
paths naming every kind of file, and names no file system would take.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiwid.config import ConfigError, check_config_main, parse_config
from tests.config.test_loader import KEYS, SHIPPED

SRC = "/etc/kiwi.toml"


def _toml_string(text: str) -> str:
    """A TOML basic string holding ``text`` (control characters escaped)."""
    return '"' + "".join(_toml_char(c) for c in text) + '"'


def _toml_char(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\u{ord(char):04x}"
    return char


def _float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


KEY_NAMES = sorted({key for _, key in KEYS} | {"sim", "gpu", "tenants", "weight"})
keys = st.sampled_from(KEY_NAMES) | st.text(max_size=8).map(_toml_string)

scalars = st.one_of(
    st.booleans().map(lambda b: "true" if b else "false"),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["0x7fffffff", "0o17", "0b101", "1_000", f"1{'0' * 4400}"]),
    st.floats().map(_float),
    st.text(max_size=20).map(_toml_string),
    st.sampled_from(['"/run/kiwi/state"', '"/run/kiwi/kiwid.sock"', '"/dev/null"', '"/"']),
    st.datetimes().map(lambda d: d.isoformat()),
    st.dates().map(str),
    st.times().map(lambda t: t.isoformat()),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda vs: "[" + ", ".join(vs) + "]"),
        st.dictionaries(keys, inner, max_size=3).map(
            lambda d: "{ " + ", ".join(f"{k} = {v}" for k, v in d.items()) + " }"
        ),
    ),
    max_leaves=6,
)
TABLES = sorted({table for table, _ in KEYS} | {"scheduler.gpu.0", 'scheduler.gpu."GPU-a"'})
tables = st.one_of(
    st.sampled_from(TABLES),
    st.sampled_from(["tenants.alice", "tenant", "x"]),
    keys.map(lambda key: f"scheduler.gpu.{key}"),
)


@st.composite
def documents(draw: st.DrawFn) -> str:
    """A TOML document: tables of known (and some unknown) keys with values of any type."""
    lines = [f"{k} = {v}" for k, v in draw(st.dictionaries(keys, values, max_size=2)).items()]
    for table in draw(st.lists(tables, max_size=5, unique=True)):
        lines.append(f"[{table}]")
        entries = draw(st.dictionaries(keys, values, max_size=5))
        lines += [f"{k} = {v}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


def _one_line_each(problems: tuple[str, ...]) -> None:
    for problem in problems:
        assert problem.isprintable(), problem  # no newline, no terminal escape


@given(documents())
def test_parse_config_raises_nothing_but_config_error(text: str) -> None:
    try:
        loaded = parse_config(text, SRC)
    except ConfigError as exc:
        problems = exc.problems
    else:
        hash(loaded.settings)
        _one_line_each(loaded.warnings)
        return
    assert problems
    assert all(p.startswith(f"{SRC}: ") for p in problems)
    _one_line_each(problems)


@given(st.text())
def test_parse_config_raises_nothing_but_config_error_on_any_text(text: str) -> None:
    with contextlib.suppress(ConfigError):
        parse_config(text, SRC)


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One of every kind of path check-config may be given."""
    d = tmp_path_factory.mktemp("paths")
    (d / "dir").mkdir()
    os.mkfifo(d / "fifo")
    (d / "zero").symlink_to("/dev/zero")
    (d / "loop").symlink_to(d / "loop")
    (d / "dangling").symlink_to(d / "nothing")
    (d / "ok.toml").write_text("scheduler.tq = 10\n", encoding="utf-8")
    (d / "odd\udcff\n.toml").write_text("scheduler.tq = 1\n", encoding="utf-8")
    (d / "short.toml").write_text("scheduler.tq = 1\n", encoding="utf-8")  # a warning
    (d / "bad.toml").write_text("scheduler.tq = -1\n", encoding="utf-8")
    (d / "latin1.toml").write_bytes(b'daemon.state_dir = "/caf\xe9"\n')
    (d / "big.toml").write_bytes(b"#" * (1 << 20) + b"\n")
    return d


NAMED = [
    "dir",
    "fifo",
    "zero",
    "loop",
    "dangling",
    "ok.toml",
    "odd\udcff\n.toml",
    "short.toml",
    "bad.toml",
    "latin1.toml",
    "big.toml",
    "absent",
    "ok.toml/below",
    "/dev/zero",
    "/dev/null",
    "/",
    "",
    str(SHIPPED),
]
# File names as the OS hands them over: any text, or bytes that are no UTF-8.
names = st.sampled_from(NAMED) | st.text(
    st.characters(codec="utf-8") | st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF)
)
argvs = st.lists(names, max_size=1) | st.lists(
    st.sampled_from(["-h", "--help", "-v", "a.toml"]) | names, min_size=1, max_size=3
)


@pytest.mark.timeout(30)
@given(argv=argvs)
def test_check_config_answers_every_path(odd_dir: Path, argv: list[str]) -> None:
    args = [str(odd_dir / a) if not a.startswith("-") else a for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = check_config_main(args)
    assert status in (0, 1, 2)
    for text in (out.getvalue(), err.getvalue()):
        text.encode("utf-8")  # a terminal can be sent it: no undecodable bytes left
        assert all(line.isprintable() for line in text.splitlines())
    assert "Traceback" not in err.getvalue()
    assert (status == 0) == (out.getvalue().endswith(": OK\n") or "usage:" in out.getvalue())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["fifo", "zero", "loop", "dir", "big.toml"])
def test_kiwid_check_config_answers_special_files(odd_dir: Path, name: str) -> None:
    run = [sys.executable, "-m", "kiwid", "check-config", str(odd_dir / name)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=20, check=False)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"{odd_dir / name}: cannot read: ")
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1, json.dumps(done.stderr)
