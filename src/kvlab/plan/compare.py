"""The seed's table: one model as MHA, GQA, MQA and MLA, at several cache dtypes, side by side."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvlab.plan.planner import PlanRequest, plan
from kvlab.plan.spec import ModelSpec
from kvlab.plan.variants import apply_variant

ROW_KEYS = ("kv_bytes_per_token", "kv_bytes_per_sequence", "cache_budget_bytes", "kv_cache_tokens", "seats",
            "max_context", "decode_ms_per_token", "decode_tokens_per_s", "binding_limit")


def compare(spec: ModelSpec, request: PlanRequest, variants: list[str], kv_dtypes: list[str]) -> list[dict[str, Any]]:
    """One row per (variant, KV dtype), each a trimmed plan plus its seats relative to the first row."""
    rows = []
    for variant in variants:
        model = apply_variant(spec, variant)
        for kv_dtype in kv_dtypes:
            result = plan(model, replace(request, kv_cache_dtype=kv_dtype, k_dtype=None, v_dtype=None, warnings=[]))
            row = {"variant": variant, "kv_cache_dtype": result["inputs"]["kv_cache_dtype"],
                   "kv_heads": result["model"]["kv_heads"], "attention_kinds": result["model"]["attention_kinds"]}
            row.update({key: result[key] for key in ROW_KEYS if key in result})
            rows.append(row)
    base = rows[0]
    for row in rows:
        row["cache_ratio"] = row["kv_bytes_per_sequence"] / base["kv_bytes_per_sequence"]
        if base.get("seats"):
            row["seats_ratio"] = row["seats"] / base["seats"]
    return rows
