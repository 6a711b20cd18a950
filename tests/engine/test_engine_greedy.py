"""Greedy output through the engine equals `kvlab generate` token for token, whatever the batching.

"Equal" allows one thing: where the reference's two best logits tie within 0.01, the engine's
packed products (another summation order) may pick the other (engine_helpers.first_divergence_is_a_tie).
"""

import pytest

from engine_helpers import PROMPTS, assert_outputs_match, assert_pool_free, collect, greedy, make_engine, reference, \
    run_all

BYTES_PER_TOKEN = {"auto": 1280, "fp16": 640, "int8": 480}  # stories260K: 5 layers x 4 KV heads x 8 x (K, V)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_workload_with_joins_and_preemption(stories_model, stories_tokenizer, kv_cache_dtype, prefix_caching):
    """Different prompt lengths, requests joining mid-flight, a pool so small that preemption happens."""
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok, kv_cache_dtype=kv_cache_dtype, block_size=8, max_num_batched_tokens=24,
                         enable_prefix_caching=prefix_caching, kv_cache_memory=11 * 8 * BYTES_PER_TOKEN[kv_cache_dtype])
    assert engine.blocks.num_blocks == 11  # 88 tokens: the four requests below cannot all fit at once
    work = list(zip(PROMPTS[:4], [40, 25, 33, 50]))
    wanted, got = {}, {}
    for i, (prompt, n) in enumerate(work):
        wanted[engine.add_request(prompt, greedy(n)).request_id] = (prompt, reference(model, tok, prompt, n,
                                                                                      kv_cache_dtype))
        for _ in range(3 * i):
            collect(engine.step(), got)  # later requests join mid-flight
    run_all(engine, got)
    assert_outputs_match(model, tok, wanted, got, kv_cache_dtype)
    assert engine.scheduler.num_preemptions > 0
    assert_pool_free(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8"])
def test_every_request_equals_kvlab_generate(stories_model, stories_tokenizer, kv_cache_dtype):
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok, kv_cache_dtype=kv_cache_dtype, block_size=16, max_num_batched_tokens=32,
                         kv_cache_memory=2_000_000)
    wanted, got = {}, {}
    for i, prompt in enumerate(PROMPTS):
        n = 20 + 7 * i
        wanted[engine.add_request(prompt, greedy(n)).request_id] = (prompt, reference(model, tok, prompt, n,
                                                                                      kv_cache_dtype))
        if i % 2:
            collect(engine.step(), got)
    assert_outputs_match(model, tok, wanted, run_all(engine, got), kv_cache_dtype)
    assert engine.scheduler.num_preemptions == 0
    assert_pool_free(engine)
