"""Kubernetes quantities as kiwid reads a GPU memory declaration, and its one range.

The expected bytes are what Kubernetes' ``resource.ParseQuantity(s).Value()`` gives
(k8s.io/apimachinery/pkg/api/resource): the number scaled by its suffix, rounded up
to a whole byte.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiwid.core.model import TenantPolicy
from kiwid.core.quantity import (
    MAX_BYTES,
    QuantityError,
    declared_bytes,
    parse_quantity,
    shown_bytes,
)

Ki, Mi, Gi = 2**10, 2**20, 2**30


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("40Gi", 40 * Gi),
        ("512Mi", 512 * Mi),
        ("1G", 10**9),
        ("1073741824", Gi),
        ("1.5Gi", 3 * Gi // 2),
        (".5Gi", Gi // 2),
        ("1.Gi", Gi),
        ("0.5Ki", 512),
        ("+5Gi", 5 * Gi),
        ("1k", 1000),
        ("1Ki", Ki),
        ("2Ti", 2 * 2**40),
        ("1M", 10**6),
        ("1E", 10**18),  # exa, not an exponent
        ("1Ei", 2**60),
        ("1e9", 10**9),
        ("1E3", 1000),  # an exponent: E followed by digits
        ("1e+3", 1000),
        ("100m", 1),  # 0.1 byte: Value() rounds up
        ("1.5", 2),
        ("1e-3", 1),
        ("0.1", 1),
        ("1.0000000001Gi", Gi + 1),  # a fraction of a byte left over rounds up
        ("9223372036854775807", MAX_BYTES),
        ("7.99999Ei", 9223360507639729740),
        ("0", 0),
        ("Gi", 0),  # no digits is zero to Kubernetes
        ("-1Gi", -Gi),
    ],
)
def test_quantities_mean_what_they_mean_to_kubernetes(text: str, nbytes: int) -> None:
    assert parse_quantity(text) == nbytes


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "it is empty"),
        ("40GB", "no Kubernetes quantity"),
        ("40 Gi", "no Kubernetes quantity"),
        (" 40Gi", "no Kubernetes quantity"),
        ("40gi", "no Kubernetes quantity"),
        ("1.2.3", "no Kubernetes quantity"),
        ("4O Gi", "no Kubernetes quantity"),
        ("1K", "its suffix 'K' is none of Ki, Mi, Gi"),
        ("1e", "its suffix 'e' is none of"),
        ("1Gi5", "its suffix 'Gi5' is none of"),
        ("8Ei", "more than 2**63 - 1 bytes"),
        ("1e19", "more than 2**63 - 1 bytes"),
        ("9223372036854775808", "more than 2**63 - 1 bytes"),
        ("1e2147483648", "its exponent 2147483648 is out of range"),
        ("1" * 65, "longer than 64 characters"),
        ("\uff14\uff10Gi", "no Kubernetes quantity"),  # fullwidth digits are no ASCII digits
    ],
)
def test_what_is_no_quantity_is_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(QuantityError, match=r"^it") as err:
        parse_quantity(text)
    assert why in str(err.value)


@given(st.integers(1, 2**20), st.sampled_from(["Ki", "Mi", "Gi", "Ti", "k", "M", "G", "T", ""]))
def test_a_whole_number_and_a_suffix_scale_exactly(number: int, suffix: str) -> None:
    scale = {"Ki": Ki, "Mi": Mi, "Gi": Gi, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    scale |= {"T": 10**12, "": 1}
    assert parse_quantity(f"{number}{suffix}") == number * scale[suffix]


@given(st.integers(0, 10**6), st.integers(0, 9999))
def test_a_fraction_rounds_up_to_a_whole_byte(whole: int, fraction: int) -> None:
    text = f"{whole}.{fraction:04d}Ki"
    exact = (whole * 10**4 + fraction) * Ki
    assert parse_quantity(text) == -(-exact // 10**4)


def test_a_declaration_is_a_quantity_or_bytes_and_more_than_nothing() -> None:
    assert declared_bytes("40Gi") == declared_bytes(40 * Gi) == 40 * Gi
    for zero in ("0", "Gi", 0, "-1Gi", -5):
        with pytest.raises(QuantityError, match="must be more than 0 bytes"):
            declared_bytes(zero)
    for other in (True, 1.5, None, ["40Gi"]):
        with pytest.raises(QuantityError, match="must be a GPU memory size"):
            declared_bytes(other)
    with pytest.raises(QuantityError, match="more than 2"):
        declared_bytes(MAX_BYTES + 1)


def test_the_core_policy_holds_a_declaration_within_that_range() -> None:
    assert TenantPolicy(memory_bytes=40 * Gi).memory_bytes == 40 * Gi
    assert TenantPolicy().memory_bytes is None
    for bad in (0, -1, MAX_BYTES + 1):
        with pytest.raises(ValueError, match=f"memory_bytes {bad}: it"):
            TenantPolicy(memory_bytes=bad)
    assert TenantPolicy.memory_refusal(Gi) is None
    assert TenantPolicy.memory_refusal("40Gi") == (
        "memory_bytes must be an integer number of bytes, not '40Gi'"
    )


def test_sizes_are_shown_as_an_operator_reads_them() -> None:
    shown = [shown_bytes(n) for n in (40 * Gi, 52 * Gi, 3 * Gi // 2, 512 * Mi, 100)]
    assert shown == ["40 GiB", "52 GiB", "1.5 GiB", "512 MiB", "100 B"]


@given(st.text(alphabet="0123456789.+-eEinumkKMGTP x", max_size=70) | st.text(max_size=70))
def test_any_text_is_a_number_of_bytes_or_refused_with_a_reason(text: str) -> None:
    why = ""
    try:
        nbytes = parse_quantity(text)
    except QuantityError as err:
        why, nbytes = str(err), 0
    assert why.startswith("it") or why == ""
    assert -MAX_BYTES <= nbytes <= MAX_BYTES
