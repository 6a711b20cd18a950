"""The numbers behind the chart page, computed by `kvlab.plan` once, in Python.

For every KV-head count and precision the page offers, each layer's exact bytes per token, its
window (or chunk) and its fixed per-sequence bytes (a linear-attention layer's state) are
exported; the page then only evaluates sum(bytes_l * min(T, window_l) + fixed_l) x batch, so its
figures are the planner's figures, not a second formula.
"""

from __future__ import annotations

from typing import Any, Optional

from kvlab.plan.capacity import cache_formats, layer_kv_bytes, max_context, state_bytes
from kvlab.plan.spec import ModelSpec

PRECISIONS = {16: "fp16", 8: "fp8", 4: "int4", 2: "int2"}


def layer_terms(spec: ModelSpec, kv_cache_dtype: str) -> list[list[Optional[int]]]:
    """[[bytes per token, window or None, fixed bytes], ...] per layer: the planner's exact coefficients.

    A state layer's bytes do not grow with the context: they are its fixed term, held once the
    sequence has a token.
    """
    formats = cache_formats(kv_cache_dtype)
    return [[0, None, state_bytes(layer, formats)] if layer.is_state else
            [layer_kv_bytes(layer, 1, formats), layer.window, 0] for layer in spec.layers]


def chart_data(spec: ModelSpec, context: int, batch: int, budget_bytes: int, kv_heads: Optional[int] = None,
               bits: int = 16) -> dict[str, Any]:
    """Everything the page needs for `spec`, with the controls' starting values."""
    choices = [n for n in range(1, spec.q_heads + 1) if spec.q_heads % n == 0]
    dense = spec.with_kv_heads(spec.kv_heads) if spec.has_mla else spec
    start_heads = kv_heads or (spec.q_heads if spec.has_mla else spec.kv_heads)

    def variant(heads: int) -> ModelSpec:
        # at its own KV-head count the model is itself (Gemma 4's global layers keep their own heads)
        return spec if heads == spec.kv_heads and not spec.has_mla else dense.with_kv_heads(heads)

    variants = {str(heads): {str(b): layer_terms(variant(heads), dtype) for b, dtype in PRECISIONS.items()}
                for heads in choices}
    data: dict[str, Any] = {
        "model": spec.name,
        "layers": spec.num_layers,
        "q_heads": spec.q_heads,
        "model_kv_heads": spec.kv_heads,
        "max_context": spec.max_context,
        "kv_head_choices": choices,
        "variants": variants,
        "start": {"kv_heads": start_heads, "bits": bits, "context": context, "batch": batch,
                  "budget_bytes": budget_bytes, "budget_gib": budget_bytes / 2**30},
    }
    if spec.has_mla:
        data["mla"] = {str(b): layer_terms(spec, dtype) for b, dtype in PRECISIONS.items()}
    # where the starting lines meet the budget (the planner's longest context; None: never), for the PNG
    formats = cache_formats(PRECISIONS[bits])
    data["crossings"] = {name: max_context(variant(heads), budget_bytes, batch, formats)
                         for name, heads in (("chosen", start_heads), ("mha", spec.q_heads))}
    return data
