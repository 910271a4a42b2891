"""The one range of a tenant's weight and priority, as the core's TenantPolicy holds it."""

from __future__ import annotations

import pytest

from kiwid.core.model import TenantPolicy

WEIGHT_RANGE = "weight must be a number from 0.01 to 1000"
PRIORITY_RANGE = "priority must be an integer from -1000 to 1000"


@pytest.mark.parametrize(
    ("weight", "shown"),
    [
        (0.001, "0.001"),
        (1000.5, "1000.5"),
        (0.0, "0"),
        (-1.0, "-1"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (2000, "2000"),
    ],
)
def test_a_weight_out_of_range_is_refused_naming_it(weight: float, shown: str) -> None:
    with pytest.raises(ValueError, match="weight") as err:
        TenantPolicy(weight=weight)
    assert str(err.value) == f"{WEIGHT_RANGE}, not {shown}"
    assert TenantPolicy.weight_refusal(weight) == str(err.value)


@pytest.mark.parametrize("priority", [1001, -1001, 10**30])
def test_a_priority_out_of_range_is_refused_naming_it(priority: int) -> None:
    with pytest.raises(ValueError, match="priority") as err:
        TenantPolicy(priority=priority)
    assert str(err.value) == f"{PRIORITY_RANGE}, not {priority!r}"
    assert TenantPolicy.priority_refusal(priority) == str(err.value)


@pytest.mark.parametrize("priority", [1.5, True])
def test_a_priority_that_is_no_integer_is_refused(priority: object) -> None:
    assert TenantPolicy.priority_refusal(priority) == f"{PRIORITY_RANGE}, not {priority!r}"


def test_the_bounds_themselves_are_accepted() -> None:
    low = TenantPolicy(weight=0.01, priority=-1000)
    high = TenantPolicy(weight=1000, priority=1000)
    assert (low.weight, low.priority, high.weight, high.priority) == (0.01, -1000, 1000, 1000)
    assert (TenantPolicy.MIN_WEIGHT, TenantPolicy.MAX_WEIGHT) == (0.01, 1000.0)
    assert (TenantPolicy.MIN_PRIORITY, TenantPolicy.MAX_PRIORITY) == (-1000, 1000)
    for good in (0.01, 1, 1000):
        assert TenantPolicy.weight_refusal(good) is None
    for good_priority in (-1000, 0, 1000):
        assert TenantPolicy.priority_refusal(good_priority) is None


@pytest.mark.parametrize(
    ("weight", "within"),
    [(0.001, 0.01), (0.0, 0.01), (5000, 1000.0), (float("inf"), 1000.0), (0.5, 0.5), (1000, 1000)],
)
def test_a_weight_is_clamped_to_the_nearest_bound(weight: float, within: float) -> None:
    assert TenantPolicy.clamp_weight(weight) == within
    assert TenantPolicy.weight_refusal(TenantPolicy.clamp_weight(weight)) is None


def test_nan_has_no_nearest_weight() -> None:
    with pytest.raises(ValueError, match=f"^{WEIGHT_RANGE}, not nan$"):
        TenantPolicy.clamp_weight(float("nan"))


@pytest.mark.parametrize(
    ("priority", "within"),
    [(1001, 1000), (-(10**30), -1000), (float("inf"), 1000), (float("-inf"), -1000), (7, 7)],
)
def test_a_priority_is_clamped_to_the_nearest_bound(priority: float, within: int) -> None:
    clamped = TenantPolicy.clamp_priority(priority)
    assert (clamped, type(clamped)) == (within, int)
    assert TenantPolicy.priority_refusal(clamped) is None


def test_nan_has_no_nearest_priority() -> None:
    with pytest.raises(ValueError, match=f"^{PRIORITY_RANGE}, not nan$"):
        TenantPolicy.clamp_priority(float("nan"))
