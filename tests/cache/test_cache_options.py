"""fp8 scales, the factory's choices, and the errors a caller sees."""

from __future__ import annotations

import pytest
import torch

from cache_helpers import plan_nbytes, rope
from kvlab.cache import CacheError, ContiguousCache, KiviCache, QuantizedCache, make_cache
from kvlab.cache.quantize import fp8_scale
from kvlab.plan.errors import PlanError

B, H, D = 1, 2, 16


@pytest.mark.parametrize("dtype,kind", [("auto", ContiguousCache), ("fp8", ContiguousCache),
                                        ("int4", QuantizedCache), ("kivi2", KiviCache)])
def test_factory_picks_the_cache_for_the_format(dtype: str, kind: type) -> None:
    cache = make_cache(dtype, 1, B, H, D, D, 8)
    assert isinstance(cache, kind) and cache.kv_format is not None and cache.num_layers == 1


def test_per_head_fp8_scale_rescues_a_quiet_head() -> None:
    """One static scale for all heads pushes a quiet head into fp8's subnormals; per head fixes it."""
    k = torch.randn(B, H, 32, D) * torch.tensor([1e-3, 1e3]).view(1, H, 1, 1)
    per_tensor = make_cache("fp8", 1, B, H, D, D, 32, k_scale=fp8_scale(k, torch.float8_e4m3fn))
    per_head = make_cache("fp8", 1, B, H, D, D, 32, k_scale=fp8_scale(k, torch.float8_e4m3fn, per_head=True))
    tensor_keys, head_keys = per_tensor.update(0, k, k)[0], per_head.update(0, k, k)[0]
    quiet = (slice(None), 0)
    assert (head_keys - k)[quiet].abs().max() < (tensor_keys - k)[quiet].abs().max() / 8
    assert ((head_keys - k).abs() <= k.abs() / 16 + 1e-9).all()  # half an e4m3 ulp, every head
    assert per_head.nbytes() == plan_nbytes("fp8", 32, B, 1, H, D, D)  # scales live outside the cache


@pytest.mark.parametrize("call,message", [
    (lambda c: c.update(0, torch.randn(B, H, 2, D + 1), torch.randn(B, H, 2, D)), "k must be"),
    (lambda c: c.update(0, torch.randn(B, H, 2, D), torch.randn(B, H, 3, D)), "new tokens"),
    (lambda c: c.update(0, torch.randn(B, H, 9, D), torch.randn(B, H, 9, D)), "max_tokens=8"),
    (lambda c: c.update(2, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)), "layer_idx 2"),
])
def test_misuse_gets_a_clear_error(call, message: str) -> None:
    with pytest.raises(CacheError, match=message):
        call(make_cache("int8", 2, B, H, D, D, 8))


def test_bad_options_are_refused() -> None:
    with pytest.raises(CacheError, match="rope"):
        make_cache("auto", 1, B, H, D, D, 8, pre_rope=True)
    with pytest.raises(CacheError, match="compute dtype"):
        make_cache("auto", 1, B, H, D, D, 8, compute_dtype=torch.int8)
    with pytest.raises(PlanError, match="multiple of the group size"):
        make_cache("kivi4", 1, B, H, D, D, 8, group_size=32, residual=48)
    with pytest.raises(PlanError, match="unknown KV cache dtype"):
        make_cache("int3", 1, B, H, D, D, 8)


def test_pre_rope_works_with_group_quantisation_too() -> None:
    k = torch.randn(B, H, 12, D)
    cache = make_cache("int8", 1, B, H, D, D, 12, group_size=8, pre_rope=True, rope=rope)
    keys, _ = cache.update(0, k, k)
    assert (keys - rope(k, torch.arange(12))).abs().max() < 0.05


def test_fp8_scales_must_match_the_heads_and_be_positive() -> None:
    with pytest.raises(CacheError, match="one per KV head"):
        make_cache("fp8", 1, B, H, D, D, 8, k_scale=[1.0, 2.0, 3.0])
    with pytest.raises(CacheError, match="positive"):
        make_cache("fp8", 1, B, H, D, D, 8, v_scale=0.0)
