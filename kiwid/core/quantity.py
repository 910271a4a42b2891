"""GPU memory as a tenant declares it: Kubernetes quantities, and the range of a declaration.

One parser for every entry point: a pod's ``kiwi.io/gpu-memory`` annotation (read by
kiwi-hook), a ``[[tenants]]`` rule's ``memory`` and ``max_memory``, and ``register``'s
``memory_bytes``. They all ask :func:`declared_bytes`, so that what one takes is
taken by all, and refused by all in the same words.

:func:`parse_quantity` reads a quantity as Kubernetes' ``resource.ParseQuantity``
does (``k8s.io/apimachinery/pkg/api/resource``) and rounds it up to a whole byte, as
its ``Value()`` does::

    <quantity> ::= <sign>? <digits>? ("." <digits>?)? <suffix>
    <suffix>   ::= Ki | Mi | Gi | Ti | Pi | Ei          (powers of 1024)
                 | n | u | m | "" | k | M | G | T | P | E   (powers of 1000)
                 | (e | E) <sign>? <digits>          (a power of ten)

So ``40Gi`` is 42949672960 bytes, ``1G`` 1000000000, ``1.5Gi`` 1610612736,
``512Mi`` 536870912, and a plain ``1073741824`` is bytes. ``40GB``, ``40 Gi`` and
``40gi`` are no quantities (Kubernetes refuses them too). Kubernetes caps a quantity
at 2**63 - 1; a declaration beyond that is refused here, as more than any card, and so
is an exponent beyond 32 bits (which Kubernetes wraps around).

A declaration is per GPU, like HAMi's ``nvidia.com/gpumem``: a tenant on two GPUs that
declares ``40Gi`` needs 40 GiB on each. Pure: standard library only.
"""

from __future__ import annotations

import re

MAX_BYTES = 2**63 - 1
"""The largest declaration: what a Kubernetes quantity (an int64) holds."""
MAX_TEXT = 64
"""The longest quantity text read (any real one is far shorter)."""
MEMORY_RANGE = 'a GPU memory size: a Kubernetes quantity such as "40Gi" or "512Mi", or bytes'
"""What a declaration must be, completing "must be ..." (the config rules say it so)."""

_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# ParseQuantity's scanner: a sign, digits, a fraction, then suffix letters, a sign and
# digits (which the suffix table judges); anything else is a malformed quantity.
_SCAN = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?([eEinumkKMGTP]*[-+]?[0-9]*)", re.ASCII)
_SUFFIXES = "Ki, Mi, Gi, Ti, Pi or Ei (1024s), k, M, G, T, P or E (1000s), or e<N>"


class QuantityError(ValueError):
    """Text that is no quantity, or a quantity no declaration can be; ``str()`` says why."""


def parse_quantity(text: str) -> int:
    """Bytes that a Kubernetes quantity means, rounded up to a whole byte.

    Args:
        text: The quantity, e.g. ``"40Gi"``.

    Returns:
        The bytes (0 for ``"0"``; negative for a negative quantity).

    Raises:
        QuantityError: it is empty, too long, malformed, has an unknown suffix, or is
            beyond 2**63 - 1 bytes.
    """
    if not text:
        raise QuantityError("it is empty")
    if len(text) > MAX_TEXT:
        raise QuantityError(f"it is longer than {MAX_TEXT} characters")
    scanned = _SCAN.fullmatch(text)
    if scanned is None:
        raise QuantityError(f"it is no Kubernetes quantity (a number, then one of {_SUFFIXES})")
    sign, whole, fraction, suffix = scanned.groups()
    fraction = (fraction or "").rstrip("0")
    base, exponent = _interpret(suffix)
    mantissa = int((whole + fraction).lstrip("0") or "0")
    if mantissa == 0:
        return 0
    if base == 10:
        value = _power_of_ten(mantissa, exponent - len(fraction))
    else:  # at most 64 digits over at most 10**64, times at most 2**60: exact
        value = -(-(mantissa << exponent) // 10 ** len(fraction))
    if value > MAX_BYTES:
        raise QuantityError("it is more than 2**63 - 1 bytes, the largest Kubernetes quantity")
    return -value if sign == "-" else value


def _interpret(suffix: str) -> tuple[int, int]:
    """(base, exponent) of a suffix, as Kubernetes' suffixer interprets it."""
    if suffix in _DECIMAL:
        return 10, _DECIMAL[suffix]
    if suffix in _BINARY:
        return 2, _BINARY[suffix]
    digits = suffix[1:]
    if len(suffix) > 1 and suffix[0] in "eE" and re.fullmatch(r"[+-]?[0-9]+", digits, re.ASCII):
        exponent = int(digits)
        # Kubernetes takes it into an int32, wrapping larger ones around: refused here.
        if -(2**31) <= exponent < 2**31:
            return 10, exponent
        raise QuantityError(f"its exponent {digits} is out of range")
    raise QuantityError(f"its suffix {suffix!r} is none of {_SUFFIXES}")


def _power_of_ten(mantissa: int, exponent: int) -> int:
    """``mantissa x 10**exponent`` rounded up, for any exponent, without huge powers."""
    digits = len(str(mantissa))
    if digits + exponent > 19:  # at least 10**19: beyond 2**63 - 1
        return MAX_BYTES + 1
    if -exponent > digits:  # less than one byte: Kubernetes rounds it up to one
        return 1
    scale: int = 10 ** abs(exponent)  # now at most 10**64
    return mantissa * scale if exponent >= 0 else -(-mantissa // scale)


def declared_bytes(value: object) -> int:
    """A declaration of GPU memory per GPU, in bytes: a quantity string or an integer.

    Args:
        value: A quantity (``"40Gi"``) or an integer number of bytes.

    Returns:
        The bytes, from 1 to :data:`MAX_BYTES`.

    Raises:
        QuantityError: why ``value`` is no declaration (not naming it: callers name
            it where it came from).
    """
    if isinstance(value, str):
        nbytes = parse_quantity(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    else:
        raise QuantityError(f"it must be {MEMORY_RANGE}, not {type(value).__name__}")
    if nbytes <= 0:
        raise QuantityError("it must be more than 0 bytes")
    if nbytes > MAX_BYTES:
        raise QuantityError("it is more than 2**63 - 1 bytes, the largest Kubernetes quantity")
    return nbytes


def shown_bytes(nbytes: int) -> str:
    """A size as an operator reads it: ``40 GiB``, ``1.5 GiB``, ``512 MiB``, ``100 B``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(size) < 1024 or unit == "PiB":
            if unit == "B":
                return f"{nbytes} B"
            return f"{size:.1f}".removesuffix(".0") + f" {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover - the loop always returns
