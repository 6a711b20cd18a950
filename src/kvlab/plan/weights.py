"""Weight bytes for a parameter count at a chosen precision.

Integer formats carry one fp16 scale per group of `group_size` weights (GPTQ/AWQ style), so
int4 at group 128 costs 4.125 bits per weight, not 4. The microscaling 4-bit floats carry their
own fixed groups: MXFP4 one E8M0 byte per 32 values (4.25 bits), NVFP4 one fp8 byte per 16
(4.5 bits). A chosen `--weight-dtype` applies to every parameter; "auto" is the checkpoint as
it ships: a GGUF file's real tensor bytes, or a config.json's `quantization_config` counted
tensor by tensor (kvlab.plan.quantized), else bf16.
"""

from __future__ import annotations

from typing import Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.spec import ModelSpec

WEIGHT_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4", "mxfp4", "nvfp4")
DEFAULT_WEIGHT_GROUP = 128
_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4, "mxfp4": 4, "nvfp4": 4}
_SCALE_BITS = 16
_MICROSCALED = {"mxfp4": 32, "nvfp4": 16}  # values per one-byte scale


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
    elif key in _MICROSCALED:
        bits += -(-spec.params_total // _MICROSCALED[key]) * 8
    return -(-bits // 8)


def active_weight_bytes(spec: ModelSpec, total_bytes: Optional[int]) -> Optional[int]:
    """Bytes read per decode step at batch 1: the active share of a mixture-of-experts model."""
    if total_bytes is None or spec.params_total is None or spec.active_params is None:
        return total_bytes
    return total_bytes * spec.active_params // spec.params_total
