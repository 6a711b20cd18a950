"""Byte sizes in and out: parse `9GiB`/`20GB`/`1e9`, print binary and decimal units unambiguously."""

from __future__ import annotations

import re

from kvlab.plan.errors import PlanError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """`9GiB` -> 9 * 2**30, `20GB` -> 20e9, `123` -> 123 bytes (a bare K/M/G/T is binary, as in vLLM)."""
    match = _PATTERN.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise PlanError(f"cannot read {text!r} as a size; write e.g. 9GiB, 20GB or 1073741824")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise PlanError(f"a size must be positive, got {text!r}")
    return value


def _human(num_bytes: float, base: int, units: tuple[str, ...]) -> str:
    value = float(num_bytes)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def binary(num_bytes: float) -> str:
    """Human size in binary units (KiB, MiB, GiB): what memory budgets are counted in."""
    return _human(num_bytes, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))


def exact_and_binary(num_bytes: int) -> str:
    """`8,196,096 B (7.82 MiB)`: the exact count a test can check, and the size a reader takes in.

    The binary figure has no thousands separator (`1,024,512 B (1000.50 KiB)`), so the two
    numbers stay apart at a glance; committed reports show it so.
    """
    if abs(num_bytes) < 1024:
        return f"{num_bytes:,} B"
    value, unit = float(num_bytes), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024:
            break
    return f"{num_bytes:,} B ({value:.2f} {unit})"


def decimal(num_bytes: float) -> str:
    """Human size in decimal units (kB, MB, GB): what datasheets quote."""
    return _human(num_bytes, 1000, ("B", "kB", "MB", "GB", "TB"))
