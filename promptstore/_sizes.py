"""Byte sizes in and out: ``"2GiB"`` -> 2147483648 and back to ``"2.0 GiB"``."""

from __future__ import annotations

import math
import re

from .errors import InvalidSizeError

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Parse a byte count: an int, or a string such as ``"512"``, ``"64KiB"``, ``"1.5 GB"``.

    ``KiB/MiB/GiB/TiB`` (and bare ``K/M/G/T``) are powers of 1024; ``KB/MB/GB/TB`` of 1000.

    Raises:
        InvalidSizeError: negative, not finite, not a whole number of bytes (``1.5``,
            ``"0.1KiB"``), or not understood.
    """
    if isinstance(value, bool):
        raise InvalidSizeError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidSizeError(f"a size cannot be negative: {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise InvalidSizeError(f"not a size: {value!r}")
        return _whole(value, value)
    if not isinstance(value, str):
        raise InvalidSizeError(f"a size is an int or a string like '2GiB', got {type(value).__name__}")
    match = _PATTERN.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidSizeError(f"not a size: {value!r} (try '512MiB' or '2GiB')")
    return _whole(float(match.group(1)) * _UNITS[match.group(2).lower()], value)


def _whole(n: float, given: object) -> int:
    # 1.5 used to become 1 byte silently; a fractional byte count is a mistake, not a size.
    if abs(n - round(n)) > 1e-9 * max(1.0, n):
        raise InvalidSizeError(f"a size is a whole number of bytes, got {given!r} ({n} bytes)")
    return int(round(n))


def format_size(n: float) -> str:
    """Return ``n`` bytes in binary units, e.g. ``"1.5 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
