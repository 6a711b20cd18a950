"""Tiny models and a cache factory shared by the nn tests."""

import pytest

from kvlab.nn.config import ModelConfig

LLAMA_TINY = ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=80, max_seq_len=64,
                         tie_embeddings=True, name="llama-tiny")
CHAR_GPT = ModelConfig(vocab_size=65, dim=32, n_layers=2, n_heads=4, mlp="gelu", norm="layernorm", bias=True,
                       rope_style="interleaved", max_seq_len=64, name="char-gpt")
MLA_TINY = ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, attention="mla", kv_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_seq_len=64, name="mla-tiny")


@pytest.fixture(params=[LLAMA_TINY, CHAR_GPT, MLA_TINY], ids=lambda c: c.name)
def tiny_config(request) -> ModelConfig:
    return request.param
