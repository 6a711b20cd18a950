"""The inverse questions: which card and tensor-parallel size serve a context at a concurrency.

A single plan already answers two inverse questions as first-class figures: `max_context`
(the longest context each of `--batch` sequences can reach) and `seats` (the most concurrent
sequences of `--context` tokens), exact in bytes for kvlab's engine and in whole blocks, with
vLLM's window reserve, for `--engine vllm`. Over a list of cards (`--gpu h100,l40s,l4`) this
plans every card at every tensor-parallel size (1, 2, 4, 8, or the one given; sizes the KV
heads cannot be split over are skipped), keeps the smallest size that serves both `--context`
and `--batch` on each card, and names the cheapest in memory (card memory x ranks) overall.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.hardware import Device
from kvlab.plan.planner import PlanRequest, plan
from kvlab.plan.spec import ModelSpec

TP_SIZES = (1, 2, 4, 8)
ROW_KEYS = ("weight_bytes_per_rank", "cache_budget_bytes", "seats", "max_context", "fits", "decode_tokens_per_s",
            "decode_ms_per_token", "binding_limit")


def card_rows(spec: ModelSpec, request: PlanRequest, cards: list[Device],
              tensor_parallel: Optional[int] = None) -> dict[str, Any]:
    """One row per card (at the smallest tensor-parallel size that serves, else the largest tried) and the answer."""
    sizes = (tensor_parallel,) if tensor_parallel else TP_SIZES
    rows = []
    for card in cards:
        tried = []
        for tp in sizes:
            warnings: list[str] = []
            try:
                result = plan(spec, replace(request, device=card, tensor_parallel=tp, warnings=warnings))
            except PlanError:
                continue  # e.g. KV heads that cannot be split over tp ranks
            request.warnings.extend(w for w in warnings if "stated limit" in w and w not in request.warnings)
            tried.append(_row(card, tp, result))
            if tried[-1]["fits"]:
                break
        if not tried:
            raise PlanError(f"no tensor-parallel size of {', '.join(map(str, sizes))} splits {spec.name}'s KV heads")
        rows.append(tried[-1])
    serving = [row for row in rows if row["fits"]]
    smallest = min(serving, key=lambda row: (row["memory_bytes"] * row["tensor_parallel_size"],
                                             row["tensor_parallel_size"])) if serving else None
    return {"model": spec.name, "inputs": {"context": request.context, "batch": request.batch,
                                           "engine": request.engine, "tensor_parallel_sizes": list(sizes)},
            "cards": rows, "smallest": smallest}


def _row(card: Device, tp: int, result: dict[str, Any]) -> dict[str, Any]:
    row = {"card": card.name, "memory_bytes": card.memory_bytes, "tensor_parallel_size": tp}
    row.update({key: result[key] for key in ROW_KEYS if key in result})
    if "vllm" in result:
        row["vllm_log_lines"] = result["vllm"]["log_lines"]
    if "does_not_fit" in result:
        row["does_not_fit"] = result["does_not_fit"]
    return row
