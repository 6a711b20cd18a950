"""Grouped-query attention against a plain repeat_interleave reference, with and without a cache."""

import math

import pytest
import torch

from kvlab.nn.attention import Attention, attend, causal_mask
from kvlab.nn.config import ModelConfig
from kvlab.nn.rope import RoPE
from kvlab.cache import make_cache


def reference_attention(q, k, v, past: int = 0):
    """Textbook attention: repeat each KV head for its group of query heads, mask, softmax."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    new, total = q.shape[-2], k.shape[-2]
    allowed = torch.arange(total)[None, :] <= torch.arange(new)[:, None] + (total - new)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1], ids=["mha", "gqa4", "gqa2", "mqa"])
@pytest.mark.parametrize("new,total", [(5, 5), (1, 9), (3, 7)], ids=["prefill", "decode", "chunk"])
def test_sdpa_gqa_matches_repeat_reference(kv_heads, new, total):
    torch.manual_seed(0)
    q = torch.randn(2, 8, new, 16)
    k, v = torch.randn(2, kv_heads, total, 16), torch.randn(2, kv_heads, total, 16)
    torch.testing.assert_close(attend(q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_query_head_reads_kv_head_h_over_group():
    """Zero every KV head but one: only that head's group of query heads sees non-zero values."""
    q = torch.randn(1, 6, 1, 4)
    k = torch.randn(1, 3, 4, 4)
    v = torch.zeros(1, 3, 4, 4)
    v[:, 1] = 1.0
    out = attend(q, k, v)[0, :, 0, 0]
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_causal_mask_offsets_new_tokens_to_the_end():
    assert causal_mask(2, 4, torch.device("cpu")).tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("kv_heads", [6, 3, 1])
def test_cached_chunks_equal_one_pass(kv_heads):
    torch.manual_seed(1)
    config = ModelConfig(vocab_size=10, dim=48, n_layers=1, n_heads=6, n_kv_heads=kv_heads, max_seq_len=32)
    attn, rope = Attention(config), RoPE(8, 32)
    x = torch.randn(2, 9, 48)
    whole = attn(x, rope)
    cache = make_cache("fp32", 1, 2, kv_heads, 8, 8, 16)
    parts = [attn(x[:, :4], rope, 0, cache), attn(x[:, 4:5], rope, 4, cache), attn(x[:, 5:], rope, 5, cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache.seq_len(0) == 9
