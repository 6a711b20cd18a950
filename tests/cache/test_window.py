"""Sinks + window: bytes bounded as the planner counts a sliding layer, the mask exact under chunking."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.window import make_window_cache
from kvlab.cache import CacheError
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.plan.spec import FULL, LayerAttention, ModelSpec

LAYERS, HEADS, DIM, WINDOW, SINKS = 2, 2, 8, 6, 2


def spec() -> ModelSpec:
    return ModelSpec("t", tuple(LayerAttention(FULL, 4, HEADS, DIM, DIM) for _ in range(LAYERS)))


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "int4", "int8"])
@pytest.mark.parametrize("chunks", [[1] * 20, [5, 3, 9, 1], [20]])
def test_held_bytes_equal_a_sliding_layer_of_sinks_plus_window(dtype: str, chunks: list[int]) -> None:
    cache = make_window_cache(dtype, LAYERS, 1, HEADS, DIM, DIM, 64, WINDOW, SINKS, group_size=4)
    windowed, formats = spec().with_kv_window(WINDOW, SINKS), cache_formats(dtype, group_size=4)
    seen = 0
    for n in chunks:
        for layer in range(LAYERS):
            cache.update(layer, torch.randn(1, HEADS, n, DIM), torch.randn(1, HEADS, n, DIM))
        seen += n
        assert cache.held_tokens() == min(seen, WINDOW + SINKS)
        assert cache.nbytes() == kv_bytes_per_sequence(windowed, seen, formats)
    assert cache.positions[0].tolist() == list(range(SINKS)) + list(range(seen - WINDOW, seen))
    assert kv_bytes_per_sequence(windowed, 10_000, formats) == kv_bytes_per_sequence(windowed, WINDOW + SINKS, formats)


def test_mask_sees_sinks_and_the_window_only() -> None:
    cache = make_window_cache("fp32", 1, 1, 1, 4, 4, 64, 3, 1)
    cache.update(0, torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4))
    mask = cache.window_mask(0, 8).int().tolist()
    # query 7 sees sink 0 and positions 4..7 (itself and the 3 before it)
    assert mask[7] == [1, 0, 0, 0, 1, 1, 1, 1]
    assert mask[2] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert cache.positions[0].tolist() == [0, 5, 6, 7]


def test_rejects_formats_without_token_rows() -> None:
    with pytest.raises(CacheError):
        make_window_cache("kivi2", 1, 1, 1, 4, 4, 64, 3, 1)
