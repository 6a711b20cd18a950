"""Accelerator catalog: memory, bandwidth and dense compute, each with its source.

Figures are the vendors' datasheet numbers for dense (non-sparse) math. Memory is given as the
datasheet states it (decimal GB, as vendors do); we keep bytes exact and say which unit we print.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

from kvlab.plan.errors import PlanError

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class Device:
    """One card: memory in bytes, bandwidth in GB/s (decimal), compute in TFLOP/s."""

    name: str
    memory_bytes: int
    bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: Optional[float] = None
    source: str = "user input"

    def __post_init__(self) -> None:
        for field_name in ("memory_bytes", "bandwidth_gbs", "bf16_tflops"):
            value = getattr(self, field_name)
            if value is None or value <= 0:
                raise PlanError(f"{field_name} must be positive, got {value!r}")


CATALOG = {
    "h100-sxm": Device("H100 SXM", 80 * GB, 3350, 989, 1979, "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense)"),
    "h200": Device("H200 SXM", 141 * GB, 4800, 989, 1979, "NVIDIA H200 Tensor Core GPU datasheet (SXM, dense)"),
    "a100-80gb": Device("A100 80GB SXM", 80 * GB, 2039, 312, None, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB, dense)"),
    "l4": Device("L4", 24 * GB, 300, 121, 242.5, "NVIDIA L4 Tensor Core GPU datasheet (dense = sparse / 2)"),
    "l40s": Device("L40S", 48 * GB, 864, 362, 733, "NVIDIA L40S datasheet (dense = sparse / 2)"),
    "rtx-4090": Device("RTX 4090", 24 * GB, 1008, 165.2, 330.3, "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090, dense)"),
    "jetson-agx-orin-64gb": Device("Jetson AGX Orin 64GB", 64 * GB, 204.8, 42.5, None,
                                   "NVIDIA Jetson AGX Orin series datasheet (shared memory; bf16 about 42.5 dense)"),
}
ALIASES = {"h100": "h100-sxm", "h200-sxm": "h200", "a100": "a100-80gb", "4090": "rtx-4090", "orin": "jetson-agx-orin-64gb"}


def device(name: str) -> Device:
    """A catalog card by name (case-insensitive, aliases allowed); one-line error with close matches."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    close = difflib.get_close_matches(key, list(CATALOG) + list(ALIASES), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known cards: {', '.join(CATALOG)}"
    raise PlanError(f"unknown GPU {name!r}{hint}")


def custom_device(memory_gib: float, bandwidth_gbs: float, tflops: float) -> Device:
    """A card described by its numbers (`--memory-gib --bandwidth-gbs --tflops`)."""
    if memory_gib is None or memory_gib <= 0:
        raise PlanError(f"--memory-gib must be positive, got {memory_gib!r}")
    return Device("custom", int(memory_gib * GIB), bandwidth_gbs, tflops)
