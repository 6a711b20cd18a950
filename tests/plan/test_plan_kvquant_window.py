"""The planner's KVQuant rows and fixed codebook bytes, and the sinks + window what-if."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_fixed_bytes
from kvlab.plan.loaders import load_model


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "smollm2-135m", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_kvquant3_rows_and_fixed_bytes_leave_the_pool_once(capsys) -> None:
    result = plan_json(capsys, "--kv-cache-dtype", "kvquant3", "--context", "8192", "--gpu", "l4")
    # 30 layers x 3 heads x (a key row: 24 code bytes + an outlier count, and 1% of 64 channels of
    # 3-byte outliers in the head's pool; a value row: 24 code bytes + fp16 scale and zero + 1 outlier)
    assert result["kv_bytes_per_token"] == pytest.approx(30 * 3 * ((24 + 1 + 0.64 * 3) + (24 + 4 + 3)))
    # the first token of a sequence is kept whole in fp16 (the attention sink); the pool has floor(0.64 n) slots
    rows = 8191
    assert result["kv_bytes_per_sequence"] == 30 * 3 * (2 * 64 * 2 + rows * (25 + 31) + (rows * 64 // 100) * 3)
    # per layer: two 8-entry fp16 codebooks and the keys' fp16 mean and scale per head and channel
    assert result["kv_fixed_bytes"] == 30 * (2 * 8 * 2 + 2 * 3 * 64 * 2)
    usable = result["cache_budget_bytes"] - result["kv_fixed_bytes"]
    assert result["seats"] == usable // result["kv_bytes_per_sequence"]
    # the model's fixed bytes are part of its cache with or without a card to seat it on
    assert plan_json(capsys, "--kv-cache-dtype", "kvquant3")["kv_fixed_bytes"] == result["kv_fixed_bytes"]
    assert main(["plan", "smollm2-135m", "--kv-cache-dtype", "kvquant3"]) == 0
    assert "KV fixed per model" in capsys.readouterr().out


def test_sinks_plus_window_bound_a_sequence_like_a_sliding_layer(capsys) -> None:
    full = plan_json(capsys, "--context", "8192")
    windowed = plan_json(capsys, "--context", "8192", "--kv-window", "256", "--sink-tokens", "4")
    assert windowed["kv_bytes_per_token"] == full["kv_bytes_per_token"]
    assert windowed["kv_bytes_per_sequence"] == 260 * full["kv_bytes_per_token"]
    spec = load_model("smollm2-135m").with_kv_window(256, 4)
    assert kv_bytes_per_sequence(spec, 100, cache_formats("fp16")) == 100 * full["kv_bytes_per_token"]
    assert kv_fixed_bytes(spec, cache_formats("fp16")) == 0
    assert main(["plan", "smollm2-135m", "--sink-tokens", "4"]) == 2
