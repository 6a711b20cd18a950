"""Argument types shared by sub-commands: numbers that must be positive, sizes with units."""

from __future__ import annotations

import argparse

from kvlab.checkpoints.resolve import PACKINGS
from kvlab.plan.errors import PlanError
from kvlab.plan.units import parse_bytes

WEIGHTS_CHOICES = ("auto", *PACKINGS)  # --weights: auto picks the GGUF's blocks where the kernels load


def _int_at_least(text: str, least: int, kind: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except PlanError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def comma_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers (batch sizes, contexts, concurrency levels, lengths)."""
    try:
        values = [int(item) for item in comma_list(text)]
    except (ValueError, argparse.ArgumentTypeError):
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,4,16, got {text!r}")
    return values
