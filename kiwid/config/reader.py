"""Walking a parsed TOML document: checking each key by its rule, showing values.

:class:`Reader` collects every problem (one line each, naming the file, the
dotted key and the value) and every warning as :mod:`kiwid.config.loader`
builds the settings; :func:`show_value` and :func:`show_key` write values and
keys as TOML would, so an operator can find them in the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kiwid.config.rules import Rule, has_kind, type_name

SHORT_TQ_S = 5.0
"""A TQ at or below this many seconds draws a warning."""

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def show_value(value: object) -> str:
    """Write ``value`` roughly as TOML would, shortened to fit on a line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = printable(json.dumps(value, ensure_ascii=False), toml=True)
    elif isinstance(value, list):
        text = "[" + ", ".join(map(show_value, value)) + "]"
    elif isinstance(value, dict):
        text = "{ " + ", ".join(f"{show_key(k)} = {show_value(v)}" for k, v in value.items()) + " }"
    elif isinstance(value, int | float):
        text = repr(value)
    else:
        text = str(value)  # TOML dates and times
    return text if len(text) <= 60 else text[:59] + "…"


def show_key(key: str) -> str:
    """Write a key as TOML would: bare when it may be, else quoted."""
    if _BARE_KEY.fullmatch(key):
        return key
    return printable(json.dumps(key, ensure_ascii=False), toml=True)


def printable(text: str, *, toml: bool = False) -> str:
    r"""Escape what cannot be shown on one line of a terminal or log.

    Control and other unprintable characters become ``\uXXXX``; with
    ``toml=False`` (file names) those below U+0100 become ``\xNN``, and so do
    the bytes a file name had that were no UTF-8 (``os.fsdecode`` turns byte NN
    into U+DCNN), so the name is shown as the bytes it is.
    """
    if text.isprintable():
        return text
    out = []
    for char in text:
        code = ord(char)
        if char.isprintable():
            out.append(char)
        elif not toml and 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif not toml and code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


class Reader:
    """Walks a parsed document, collecting problems and warnings as it goes."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.refused: set[str] = set()  # dotted keys whose value was refused

    def problem(self, text: str) -> None:
        """Note a problem of the file (prefixed with its name)."""
        self.problems.append(f"{self.label}: {text}")

    def table(self, parent: Mapping[str, Any], name: str, dotted: str = "") -> dict[str, Any]:
        """Return ``parent[name]`` if it is a table (or absent: ``{}``), else note why."""
        value = parent.get(name, {})
        if isinstance(value, dict):
            return value
        self.problem(
            f"{dotted or name} = {show_value(value)}: must be a table, not {type_name(value)}"
        )
        return {}

    def section(
        self, doc: Mapping[str, Any], name: str, rules: Mapping[str, Rule]
    ) -> dict[str, Any]:
        """Check the top-level table ``name`` against ``rules``."""
        return self.fields(self.table(doc, name), name, rules)

    def fields(
        self,
        table: Mapping[str, Any],
        prefix: str,
        rules: Mapping[str, Rule],
        subtables: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Check every key of ``table``; return valid values keyed by dataclass field."""
        values: dict[str, Any] = {}
        for key, value in table.items():
            dotted = f"{prefix}.{show_key(key)}" if prefix else show_key(key)
            rule = rules.get(key)
            if rule is None:
                if key not in subtables:
                    known = ", ".join([*rules, *subtables])
                    self.problem(f"unknown key {dotted} (known keys: {known})")
                continue
            kind_ok = has_kind(value, rule.kind)
            objection = rule.objects(value) if kind_ok else None
            if objection is not None:
                self.refused.add(dotted)
                self.problem(f"{dotted} = {show_value(value)}: {objection}")
            elif kind_ok and rule.accepts(value):
                stored = value
                if rule.convert is not None:
                    stored = rule.convert(value)
                elif rule.kind is float:
                    stored = float(value)
                elif rule.kind is list:
                    stored = tuple(value)  # frozen settings stay hashable
                values[rule.attr] = stored
                if rule.attr == "tq" and value <= SHORT_TQ_S:
                    self.warnings.append(
                        f"{dotted} = {show_value(value)}: a TQ of {SHORT_TQ_S:g} s or less is "
                        "discouraged: each hand-over moves the tenant's GPU memory, so a "
                        "short quantum is spent waiting for data"
                    )
            else:
                got = "" if kind_ok else f", not {type_name(value)}"
                self.refused.add(dotted)
                self.problem(f"{dotted} = {show_value(value)}: must be {rule.expects}{got}")
        return values
