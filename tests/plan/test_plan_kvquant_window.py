"""The planner's KVQuant rows and fixed codebook bytes, and the sinks + window what-if."""

from __future__ import annotations

import json

from kvlab.cli import main
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_fixed_bytes
from kvlab.plan.loaders import load_model


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "smollm2-135m", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_kvquant3_rows_and_fixed_bytes_leave_the_pool_once(capsys) -> None:
    result = plan_json(capsys, "--kv-cache-dtype", "kvquant3", "--context", "8192", "--gpu", "l4")
    # 30 layers x (K + V) x 3 heads x (24 code bytes + 4 scale/zero + 1 outlier of 3 bytes)
    assert result["kv_bytes_per_token"] == 30 * 2 * 3 * 31
    # per layer: two 8-entry fp16 codebooks and the keys' fp16 mean and scale per head and channel
    assert result["kv_fixed_bytes"] == 30 * (2 * 8 * 2 + 2 * 3 * 64 * 2)
    usable = result["cache_budget_bytes"] - result["kv_fixed_bytes"]
    assert result["seats"] == usable // result["kv_bytes_per_sequence"]


def test_sinks_plus_window_bound_a_sequence_like_a_sliding_layer(capsys) -> None:
    full = plan_json(capsys, "--context", "8192")
    windowed = plan_json(capsys, "--context", "8192", "--kv-window", "256", "--sink-tokens", "4")
    assert windowed["kv_bytes_per_token"] == full["kv_bytes_per_token"]
    assert windowed["kv_bytes_per_sequence"] == 260 * full["kv_bytes_per_token"]
    spec = load_model("smollm2-135m").with_kv_window(256, 4)
    assert kv_bytes_per_sequence(spec, 100, cache_formats("fp16")) == 100 * full["kv_bytes_per_token"]
    assert kv_fixed_bytes(spec, cache_formats("fp16")) == 0
    assert main(["plan", "smollm2-135m", "--sink-tokens", "4"]) == 2
