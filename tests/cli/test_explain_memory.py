"""``kiwictl explain`` on a tenant's declared GPU memory, from canned status objects."""

from __future__ import annotations

import copy
from typing import Any

from tests.cli.test_explain import STATUS, explain

Gi = 2**30


def with_memory(**fields: Any) -> dict[str, Any]:
    status = copy.deepcopy(STATUS)
    status["gpus"][0]["tenants"][1].update(fields)  # pid:777, waiting
    return status


def test_a_tenant_that_uses_more_than_it_declared_is_told_so() -> None:
    status = with_memory(declared_bytes=40 * Gi, declared_source="annotation", peak_bytes=52 * Gi)
    text = explain("777", status)
    assert (
        "It declared 40 GiB, uses 52 GiB: more than it declared (its pod's annotation "
        "kiwi.io/gpu-memory), so it is sized by what it uses; memory it takes beyond what "
        "is free beside the others may fail to allocate."
    ) in text


def test_a_declaration_within_what_it_uses_says_where_it_came_from() -> None:
    status = with_memory(declared_bytes=40 * Gi, declared_source="rule 2", peak_bytes=12 * Gi)
    assert (
        "It declared 40 GiB of GPU memory per GPU (rule 2 of /etc/kiwi.toml), and uses 12 GiB "
        "at most so far: its turns make room for that much, not for the whole card."
    ) in explain("777", status)
    status = with_memory(declared_bytes=3 * Gi // 2, declared_source="register", peak_bytes=None)
    assert "It declared 1.5 GiB of GPU memory per GPU (its registration): its" in explain(
        "777", status
    )


def test_no_declaration_no_sentence_and_an_older_daemon_is_understood() -> None:
    assert "declared" not in explain("777")  # an older kiwid sends no such fields
    assert "declared" not in explain("777", with_memory(declared_bytes=None, peak_bytes=Gi))
