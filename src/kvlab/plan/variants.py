"""What-if attention variants by name: `mha`, `gqa:8`, `mqa`, `mla`, `mla:512:64`, `kv:4`, `base`."""

from __future__ import annotations

from kvlab.plan.errors import PlanError
from kvlab.plan.spec import ModelSpec

DEFAULT_MLA_RANK = 512  # DeepSeek-V2's kv_lora_rank, also TransMLA's target
DEFAULT_MLA_ROPE = 64


def apply_variant(spec: ModelSpec, variant: str) -> ModelSpec:
    """`spec` turned into the named variant; a one-line error for names it cannot read."""
    name, _, rest = variant.strip().lower().partition(":")
    try:
        numbers = [int(part) for part in rest.split(":")] if rest else []
    except ValueError:
        raise PlanError(f"cannot read variant {variant!r}; expected e.g. mha, gqa:8, mqa, mla, mla:512:64") from None
    if name in ("base", "orig", "model") and not numbers:
        return spec
    if name == "mha" and not numbers:
        return spec.with_kv_heads(spec.q_heads)
    if name == "mqa" and not numbers:
        return spec.with_kv_heads(1)
    if name in ("gqa", "kv") and len(numbers) == 1:
        return spec.with_kv_heads(numbers[0])
    if name == "mla" and len(numbers) in (0, 2):
        rank, rope = numbers or (DEFAULT_MLA_RANK, DEFAULT_MLA_ROPE)
        return spec.with_mla(rank, rope)
    raise PlanError(f"cannot read variant {variant!r}; expected e.g. mha, gqa:8, mqa, mla, mla:512:64")
