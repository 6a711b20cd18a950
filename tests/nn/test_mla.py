"""MLA (DeepSeek-V2): the absorbed decode path equals the naive one; the cache holds only the latent."""

import torch

from kvlab.nn.config import ModelConfig
from kvlab.nn.mla import MLA
from kvlab.nn.rope import RoPE
from kvlab.cache import make_latent_cache

CONFIG = ModelConfig(vocab_size=10, dim=64, n_layers=1, n_heads=4, attention="mla", kv_lora_rank=32,
                     qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_seq_len=64)


def run(absorb: bool, x: torch.Tensor, module: MLA, chunks=(6, 1, 1, 3)):
    module.absorb = absorb
    rope = RoPE(CONFIG.qk_rope_head_dim, CONFIG.max_seq_len)
    cache = make_latent_cache("fp32", 1, x.shape[0], CONFIG.kv_lora_rank, CONFIG.qk_rope_head_dim, 32)
    outs, start = [], 0
    for size in chunks:
        outs.append(module(x[:, start:start + size], rope, start, cache))
        start += size
    return torch.cat(outs, dim=1), cache


def test_absorbed_equals_naive_within_1e5_fp32():
    """ANCHORS (DeepSeek-V2 MLA): absorbed and naive paths agree within 1e-5 in fp32."""
    torch.manual_seed(0)
    module = MLA(CONFIG)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(2, 11, 64)
    naive, _ = run(False, x, module)
    absorbed, cache = run(True, x, module)
    assert (naive - absorbed).abs().max().item() < 1e-5
    assert naive.abs().max().item() > 0.1  # not trivially small


def test_cached_equals_uncached_and_cache_holds_latent_only():
    torch.manual_seed(1)
    module = MLA(CONFIG)
    x = torch.randn(1, 11, 64)
    cached, cache = run(False, x, module)
    torch.testing.assert_close(cached, module(x, RoPE(8, 64)), rtol=1e-5, atol=1e-6)
    # one row per token of latent (32) + shared RoPE key (8), fp32, one layer, preallocated for
    # 32 tokens: nothing per head, no K or V of their own
    assert cache.seq_len(0) == 11
    assert [tuple(t.shape) for t in cache.tensors()] == [(1, 32, 32 + 8)]
    assert cache.nbytes() == 32 * (32 + 8) * 4
