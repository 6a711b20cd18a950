"""Attention through a cache equals attention recomputed over the whole sequence.

Queries arrive in chunks (a prefill, then decode steps, then a few multi-token steps) whose
boundaries cross the paged pool's blocks; every chunk's output must match the matching rows
of one causal SDPA pass over all tokens, with grouped-query heads (enable_gqa). The lab's
reference caches and the engine's pool (cache_helpers.PoolRows) are held to the same standard.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from cache_helpers import PoolRows, attend, rope
from kvlab.cache import make_cache

BATCH, Q_HEADS, KV_HEADS, DIM, LAYERS = 2, 4, 2, 16, 2
CHUNKS = [7, 1, 1, 1, 4, 1, 9, 1, 3]  # 28 tokens: crosses blocks of 5 at uneven points


def run(cache, q, k, v, chunks, layer=0, roped_keys=None):
    """Feed chunks to `cache` in `layer` and compare each chunk's attention to full recompute."""
    keys_for_reference = roped_keys if roped_keys is not None else k
    reference = F.scaled_dot_product_attention(q, keys_for_reference, v, is_causal=True, enable_gqa=True)
    start, worst = 0, 0.0
    for n in chunks:
        end = start + n
        keys, values = cache.update(layer, k[:, :, start:end], v[:, :, start:end])
        out = attend(q[:, :, start:end], keys, values, start)
        worst = max(worst, float((out - reference[:, :, start:end]).abs().max()))
        start = end
    return worst


def inputs(tokens: int, dtype: torch.dtype = torch.float32):
    q = torch.randn(BATCH, Q_HEADS, tokens, DIM, dtype=dtype)
    k = torch.randn(BATCH, KV_HEADS, tokens, DIM, dtype=dtype)
    v = torch.randn(BATCH, KV_HEADS, tokens, DIM, dtype=dtype)
    return q, k, v


def cache_for(dtype: str, paged: bool, block_size: int = 5, compute_dtype=torch.float32, layers: int = 1,
              **options):
    if paged:
        return PoolRows(dtype, layers, BATCH, KV_HEADS, DIM, 32, block_size, compute_dtype=compute_dtype, **options)
    return make_cache(dtype, layers, BATCH, KV_HEADS, DIM, DIM, 32, compute_dtype=compute_dtype, **options)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("block_size", [5, 16])
def test_full_precision_cache_matches_recompute(paged: bool, block_size: int) -> None:
    q, k, v = inputs(sum(CHUNKS))
    for layer in range(LAYERS):
        cache = cache_for("auto", paged, block_size, layers=LAYERS)
        assert run(cache, q, k, v, CHUNKS, layer) < 1e-5


@settings(max_examples=10, deadline=None)
@given(chunks=st.lists(st.integers(1, 12), min_size=1, max_size=6), block_size=st.sampled_from([1, 3, 4, 8]))
def test_paged_cache_matches_recompute_for_any_chunking(chunks: list[int], block_size: int) -> None:
    q, k, v = inputs(sum(chunks))
    cache = PoolRows("auto", 1, BATCH, KV_HEADS, DIM, 72, block_size)
    assert run(cache, q, k, v, chunks) < 1e-5


def test_pre_rope_cache_matches_recompute_with_roped_keys() -> None:
    """A pre-RoPE cache takes raw keys and applies RoPE on read at positions 0..T-1."""
    q, k, v = inputs(sum(CHUNKS))
    roped = rope(k, torch.arange(k.shape[2]))
    cache = make_cache("auto", 1, BATCH, KV_HEADS, DIM, DIM, 32, pre_rope=True, rope=rope)
    assert run(cache, q, k, v, CHUNKS, roped_keys=roped) < 1e-5


@pytest.mark.parametrize("paged", [False, True])
def test_half_precision_compute_matches_recompute(paged: bool) -> None:
    q, k, v = inputs(sum(CHUNKS), torch.bfloat16)
    cache = cache_for("auto", paged, compute_dtype=torch.bfloat16)
    assert run(cache, q, k, v, CHUNKS) < 2e-2


LOSSY = [("fp16", 2e-3), ("fp8", 0.15), ("int8", 2e-2), ("kivi4", 0.15)]


@pytest.mark.parametrize("dtype,tolerance,paged", [(d, t, p) for d, t in LOSSY for p in (False, True)])
def test_lossy_caches_stay_close_to_recompute(dtype: str, tolerance: float, paged: bool) -> None:
    q, k, v = inputs(sum(CHUNKS))
    cache = cache_for(dtype, paged, 8 if dtype.startswith("kivi") else 5, group_size=8,
                      residual=8 if dtype.startswith("kivi") else None)
    assert run(cache, q, k, v, CHUNKS) < tolerance


@pytest.mark.parametrize("dtype", ["fp16", "int4", "kivi2"])
def test_reference_caches_and_the_pool_give_identical_keys_and_values(dtype: str) -> None:
    _, k, v = inputs(23)
    options = dict(group_size=8, residual=8) if dtype.startswith("kivi") else {}
    contiguous = make_cache(dtype, 1, BATCH, KV_HEADS, DIM, DIM, 23, **options)
    paged = PoolRows(dtype, 1, BATCH, KV_HEADS, DIM, 23, 8 if options else 4, **options)
    for start, end in [(0, 6), (6, 7), (7, 23)]:
        a = contiguous.update(0, k[:, :, start:end], v[:, :, start:end])
        b = paged.update(0, k[:, :, start:end], v[:, :, start:end])
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
