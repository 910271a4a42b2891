"""A ``[[tenants]]`` rule's ``memory`` and ``max_memory``: quantities or bytes, or a clear error."""

from __future__ import annotations

import pytest

from kiwid.config import ConfigError, parse_config

SRC = "/etc/kiwi.toml"
Gi = 2**30
SIZE = 'must be a GPU memory size: a Kubernetes quantity such as "40Gi" or "512Mi", or bytes'


def rule(lines: str) -> tuple[int | None, int | None]:
    (read,) = parse_config(f"[[tenants]]\nmatch = {{}}\n{lines}\n", SRC).settings.tenants
    return read.memory, read.max_memory


def test_a_rule_declares_memory_as_a_quantity_or_bytes() -> None:
    assert rule('memory = "40Gi"') == (40 * Gi, None)
    assert rule('memory = "1.5Gi"\nmax_memory = "64G"') == (3 * Gi // 2, 64 * 10**9)
    assert rule(f"memory = {40 * Gi}") == (40 * Gi, None)
    assert rule('max_memory = "512Mi"') == (None, 512 * 2**20)
    assert rule("weight = 2") == (None, None)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('memory = "40GB"', f'tenants[0].memory = "40GB": {SIZE}: it is no Kubernetes quantity'),
        ('memory = "40 Gi"', f'tenants[0].memory = "40 Gi": {SIZE}: it is no Kubernetes quantity'),
        ('memory = "1K"', f"tenants[0].memory = \"1K\": {SIZE}: its suffix 'K' is none of"),
        ('memory = ""', f'tenants[0].memory = "": {SIZE}: it is empty'),
        ("memory = 0", f"tenants[0].memory = 0: {SIZE}: it must be more than 0 bytes"),
        ('max_memory = "0Gi"', f'tenants[0].max_memory = "0Gi": {SIZE}: it must be more than 0'),
        ('memory = "-4Gi"', f'tenants[0].memory = "-4Gi": {SIZE}: it must be more than 0 bytes'),
        ('memory = "8Ei"', f'tenants[0].memory = "8Ei": {SIZE}: it is more than 2**63 - 1 bytes'),
        ("memory = 40.5", f"tenants[0].memory = 40.5: {SIZE}, not a float"),
        ("memory = true", f"tenants[0].memory = true: {SIZE}, not a boolean"),
        ('memory = ["40Gi"]', f'tenants[0].memory = ["40Gi"]: {SIZE}, not an array'),
    ],
)
def test_a_memory_that_is_no_size_names_the_file_rule_key_and_value(
    line: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as err:
        rule(line)
    (found,) = err.value.problems
    assert found.startswith(f"{SRC}: {problem}"), found


def test_every_bad_rule_is_reported_at_once() -> None:
    text = '[[tenants]]\nmatch = {}\nmemory = "4O Gi"\n[[tenants]]\nmatch = {}\nmax_memory = 0\n'
    with pytest.raises(ConfigError) as err:
        parse_config(text, SRC)
    assert [p.split(" = ")[0] for p in err.value.problems] == [
        f"{SRC}: tenants[0].memory",
        f"{SRC}: tenants[1].max_memory",
    ]
