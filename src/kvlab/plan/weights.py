"""Weight bytes for a parameter count at a chosen precision.

Integer formats carry one fp16 scale per group of `group_size` weights (GPTQ/AWQ style), so
int4 at group 128 costs 4.125 bits per weight, not 4. A GGUF file's real tensor bytes beat any
estimate and are used when known.
"""

from __future__ import annotations

from typing import Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.spec import ModelSpec

WEIGHT_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4")
DEFAULT_WEIGHT_GROUP = 128
_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
_SCALE_BITS = 16


def weight_bytes(spec: ModelSpec, dtype: str = "auto", group_size: int = DEFAULT_WEIGHT_GROUP) -> Optional[int]:
    """Bytes of all weights; "auto" is the file's real bytes when known, else bf16."""
    key = dtype.lower()
    if key not in WEIGHT_DTYPES:
        raise PlanError(f"unknown weight dtype {dtype!r}; expected one of {', '.join(WEIGHT_DTYPES)}")
    if key == "auto":
        if spec.weight_bytes is not None:
            return spec.weight_bytes
        key = "bf16"
    if spec.params_total is None:
        return None
    if group_size <= 0:
        raise PlanError(f"--weight-group-size must be positive, got {group_size}")
    bits = spec.params_total * _BITS[key]
    if key in ("int8", "int4"):
        bits += -(-spec.params_total // group_size) * _SCALE_BITS
    return -(-bits // 8)


def active_weight_bytes(spec: ModelSpec, total_bytes: Optional[int]) -> Optional[int]:
    """Bytes read per decode step at batch 1: the active share of a mixture-of-experts model."""
    if total_bytes is None or spec.params_total is None or spec.active_params is None:
        return total_bytes
    return total_bytes * spec.active_params // spec.params_total
