"""Every cache holds exactly the bytes kvlab.plan counts for it, whatever the chunking.

Sizes: G = 8 (channel groups for int formats, token groups for KIVI), R = 16 (KIVI residual),
block_size 5; K and V head dims differ (20 and 12, 20 not a multiple of G: a partial group).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cache_helpers import plan_nbytes
from kvlab.cache import make_cache

LAYERS, BATCH, HEADS, DK, DV, MAX = 2, 2, 3, 20, 12, 64
G, R, BLOCK = 8, 16, 5
TOKEN_COUNTS = [1, G - 1, G, R, R + G - 1, R + G, 3 * R + 5, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 3]

# name -> (kv_cache_dtype, make_cache options, tokens the plan is asked about for T tokens held)
KINDS = {
    "contiguous-auto": ("auto", {}, lambda t: MAX),
    "contiguous-fp16": ("fp16", {}, lambda t: MAX),
    "contiguous-bf16": ("bf16", {}, lambda t: MAX),
    "contiguous-fp8": ("fp8", {}, lambda t: MAX),
    "contiguous-fp8_e5m2": ("fp8_e5m2", {}, lambda t: MAX),
    "int8": ("int8", {"group_size": G}, lambda t: t),
    "int4": ("int4", {"group_size": G}, lambda t: t),
    "int2": ("int2", {"group_size": G}, lambda t: t),
    "kivi2": ("kivi2", {"group_size": G, "residual": R}, lambda t: t),
    "kivi4": ("kivi4", {"group_size": G, "residual": R}, lambda t: t),
    "kivi2-no-residual": ("kivi2", {"group_size": G, "residual": 0}, lambda t: t),
    "paged-auto": ("auto", {"paged": True, "block_size": BLOCK}, lambda t: -(-t // BLOCK) * BLOCK),
    "paged-fp8": ("fp8", {"paged": True, "block_size": BLOCK}, lambda t: -(-t // BLOCK) * BLOCK),
    "paged-int4": ("int4", {"paged": True, "block_size": BLOCK, "group_size": G}, lambda t: -(-t // BLOCK) * BLOCK),
}


def build(kind: str, compute_dtype: torch.dtype = torch.float32):
    dtype, options, _ = KINDS[kind]
    return make_cache(dtype, LAYERS, BATCH, HEADS, DK, DV, MAX, compute_dtype=compute_dtype, **options)


def expected(kind: str, tokens: int, model_dtype: str = "fp32") -> int:
    dtype, options, planned = KINDS[kind]
    return plan_nbytes(dtype, planned(tokens), BATCH, LAYERS, HEADS, DK, DV, model_dtype,
                       options.get("group_size"), options.get("residual"))


def feed(cache, chunks: list[int], dtype: torch.dtype = torch.float32) -> None:
    """Append chunks of tokens to every layer, one layer after another as a forward pass does."""
    for n in chunks:
        k, v = torch.randn(BATCH, HEADS, n, DK, dtype=dtype), torch.randn(BATCH, HEADS, n, DV, dtype=dtype)
        for layer in range(LAYERS):
            keys, values = cache.update(layer, k, v)
            assert keys.dtype == values.dtype == dtype
            assert keys.shape == (BATCH, HEADS, cache.seq_len(layer), DK)
            assert values.shape == (BATCH, HEADS, cache.seq_len(layer), DV)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_nbytes_equals_plan_for_one_prefill(kind: str, tokens: int) -> None:
    cache = build(kind)
    feed(cache, [tokens])
    assert cache.seq_len() == cache.seq_len(LAYERS - 1) == tokens
    assert cache.nbytes() == expected(kind, tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_nbytes_equals_plan_at_every_decode_step(kind: str) -> None:
    cache = build(kind)
    feed(cache, [3])
    for tokens in range(4, 3 * R + 6):
        feed(cache, [1])
        assert cache.nbytes() == expected(kind, tokens), tokens


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), chunks=st.lists(st.integers(1, 16), min_size=1, max_size=4))
def test_nbytes_depends_only_on_tokens_held(kind: str, chunks: list[int]) -> None:
    cache = build(kind)
    feed(cache, chunks)
    assert cache.nbytes() == expected(kind, sum(chunks))


@pytest.mark.parametrize("kind", ["contiguous-auto", "kivi4", "int4", "paged-auto"])
@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
def test_half_precision_compute(kind: str, compute: torch.dtype) -> None:
    """"auto" and the KIVI residual take the compute dtype's bytes (the plan's model dtype)."""
    cache = build(kind, compute)
    feed(cache, [R + G + 3], compute)
    assert cache.nbytes() == expected(kind, R + G + 3, {torch.float16: "fp16", torch.bfloat16: "bf16"}[compute])


@pytest.mark.parametrize("kind", KINDS)
def test_reset_forgets_tokens_and_releases_growing_storage(kind: str) -> None:
    cache = build(kind)
    feed(cache, [R + G])
    cache.reset()
    assert cache.seq_len() == 0
    assert cache.nbytes() == expected(kind, 0)
    feed(cache, [G])
    assert cache.nbytes() == expected(kind, G)


def test_fp8_e4m3_is_one_byte_per_element_half_of_fp16() -> None:
    fp8, fp16 = build("contiguous-fp8"), build("contiguous-fp16")
    assert all(t.dtype == torch.float8_e4m3fn and t.element_size() == 1 for t in fp8.tensors())
    assert 2 * fp8.nbytes() == fp16.nbytes()


@pytest.mark.parametrize("kind,per_byte", [("int4", 2), ("int2", 4), ("kivi2", 4), ("kivi4", 2)])
def test_codes_are_packed_several_per_byte(kind: str, per_byte: int) -> None:
    """Rows of D codes take ceil(D / per_byte) bytes: 2 int4 or 4 int2 codes share a byte."""
    cache = build(kind)
    feed(cache, [R + G])
    widths = sorted(t.shape[-1] for t in cache.tensors() if t.dtype == torch.uint8)
    assert widths == [-(-DV // per_byte)] * LAYERS + [-(-DK // per_byte)] * LAYERS
