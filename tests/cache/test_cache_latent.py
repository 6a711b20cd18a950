"""The MLA latent cache: one row of kv_lora_rank + rope_dim elements per token (DeepSeek-V2)."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheError, LatentCache, make_latent_cache
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.plan.spec import LayerAttention, ModelSpec

LAYERS, BATCH, RANK, ROPE, MAX = 2, 3, 32, 8, 40


def plan_bytes(dtype: str, model_dtype: str = "fp32") -> int:
    layer = LayerAttention("mla", q_heads=4, kv_heads=4, k_head_dim=24, v_head_dim=16, kv_lora_rank=RANK,
                           qk_rope_head_dim=ROPE)
    spec = ModelSpec("mla-test", (layer,) * LAYERS)
    return BATCH * kv_bytes_per_sequence(spec, MAX, cache_formats(dtype, model_dtype=model_dtype))


@pytest.mark.parametrize("dtype", ["auto", "fp16", "bf16", "fp32", "fp8", "fp8_e5m2"])
def test_nbytes_equals_plan_for_an_mla_layer(dtype: str) -> None:
    cache = make_latent_cache(dtype, LAYERS, BATCH, RANK, ROPE, MAX)
    assert cache.nbytes() == plan_bytes(dtype)
    cache.update(0, torch.randn(BATCH, 5, RANK), torch.randn(BATCH, 5, ROPE))
    assert cache.nbytes() == plan_bytes(dtype)


def test_half_precision_auto_uses_the_compute_dtype() -> None:
    cache = make_latent_cache("auto", LAYERS, BATCH, RANK, ROPE, MAX, compute_dtype=torch.bfloat16)
    assert cache.nbytes() == plan_bytes("auto", "bf16")


def test_round_trip_and_split_across_updates() -> None:
    cache = make_latent_cache("auto", LAYERS, BATCH, RANK, ROPE, MAX)
    latent, k_rope = torch.randn(BATCH, 9, RANK), torch.randn(BATCH, 9, ROPE)
    for layer in range(LAYERS):
        cache.update(layer, latent[:, :6], k_rope[:, :6])
        c_all, r_all = cache.update(layer, latent[:, 6:], k_rope[:, 6:])
        assert torch.equal(c_all, latent) and torch.equal(r_all, k_rope)
        assert cache.seq_len(layer) == 9
    cache.reset()
    assert cache.seq_len() == 0


def test_fp8_latent_is_close_with_a_static_scale() -> None:
    latent, k_rope = torch.randn(BATCH, 7, RANK) * 50, torch.randn(BATCH, 7, ROPE) * 50
    cache = make_latent_cache("fp8", 1, BATCH, RANK, ROPE, MAX, scale=float(latent.abs().max()) / 448)
    c_all, r_all = cache.update(0, latent, k_rope)
    assert ((c_all - latent).abs() <= latent.abs() / 16 + 1e-2).all()
    assert ((r_all - k_rope).abs() <= k_rope.abs() / 16 + 1e-2).all()


def test_rejects_quantised_formats_and_wrong_shapes() -> None:
    with pytest.raises(CacheError, match="float formats"):
        make_latent_cache("int4", LAYERS, BATCH, RANK, ROPE, MAX)
    cache = make_latent_cache("auto", LAYERS, BATCH, RANK, ROPE, MAX)
    assert isinstance(cache, LatentCache)
    with pytest.raises(CacheError, match="latent must be"):
        cache.update(0, torch.randn(BATCH, 2, RANK + 1), torch.randn(BATCH, 2, ROPE))
    with pytest.raises(CacheError, match="max_tokens"):
        cache.update(0, torch.randn(BATCH, MAX + 1, RANK), torch.randn(BATCH, MAX + 1, ROPE))
