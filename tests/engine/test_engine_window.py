"""The sinks + window policy in the engine (StreamingLLM): blocks out of every future query's window
are handed back after each step, and the output is the lab's sinks + window cache's, token for token.

The lab's reference (kvlab.cache.window.SinkWindowCache) drops token rows; the engine drops
whole blocks and masks, in the blocks it keeps, what the policy hides: the same attention.
"""

import pytest
import torch

from engine_helpers import PROMPTS, assert_pool_free, greedy, make_engine
from kvlab.cache.step import RELEASED
from kvlab.cache.window import make_window_cache
from kvlab.engine.errors import RequestError
from kvlab.nn.generate import generate
from kvlab.plan.vllm_blocks import vllm_capacity

WINDOW, SINKS, BLOCK = 24, 4, 8


def windowed_reference(model, tokenizer, prompt: str, max_tokens: int, kv_cache_dtype: str = "auto") -> list[int]:
    ids = tokenizer.encode(prompt)
    c = model.config
    cache = make_window_cache(kv_cache_dtype, c.n_layers, 1, c.kv_heads, c.head_size, c.head_size,
                              len(ids) + max_tokens, WINDOW, SINKS, compute_dtype=model.dtype)
    return generate(model, ids, max_tokens, stop_ids=[tokenizer.eos_id], cache=cache)[0].tolist()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_output_equals_the_lab_window_cache(stories_model, stories_tokenizer, kv_cache_dtype):
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK, max_num_batched_tokens=16,
                         kv_window=WINDOW, sink_tokens=SINKS)
    wanted, held = {}, []
    for prompt, n in zip(PROMPTS[:3], [120, 90, 150]):
        request = engine.add_request(prompt, greedy(n))
        wanted[request.request_id] = (prompt, windowed_reference(model, tok, prompt, n, kv_cache_dtype))
    got: dict[str, list[int]] = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for delta in engine.step():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
            held += [engine.blocks.held_blocks(seq) for seq in engine.scheduler.running]
    assert {rid: got[rid] for rid in wanted} == {rid: want for rid, (_, want) in wanted.items()}
    assert max(len(ids) for _, ids in wanted.values()) > 3 * WINDOW  # the window really slid
    # a sequence never holds more than its sink block, the window and one step's chunk
    assert max(held) <= 1 + -(-(WINDOW + 16) // BLOCK) + 1
    assert_pool_free(engine)


def test_released_blocks_and_a_request_longer_than_the_pool(stories_model, stories_tokenizer):
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok, block_size=BLOCK, max_num_batched_tokens=16, kv_window=WINDOW,
                         sink_tokens=SINKS, kv_cache_memory=12 * BLOCK * 1280)  # 12 blocks = 96 tokens
    assert engine.blocks.num_blocks == 12
    request = engine.add_request(PROMPTS[0], greedy(200))  # 200 tokens would need 26 blocks without the window
    seq = engine.requests[request.request_id][0]
    with torch.inference_mode():
        for _ in range(60):
            engine.step()
    assert seq.block_table[0] != RELEASED  # the sinks' block stays
    assert RELEASED in seq.block_table[1:-3]
    with torch.inference_mode():
        engine.run_until_done()
    assert_pool_free(engine)
    unbounded = make_engine(model, tok, block_size=BLOCK, kv_cache_memory=12 * BLOCK * 1280)
    with pytest.raises(RequestError, match="KV blocks"):
        unbounded.add_request(PROMPTS[0], greedy(200))


def test_capacity_lines_are_the_plans_for_the_windowed_model(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer, block_size=BLOCK, kv_window=WINDOW, sink_tokens=SINKS,
                         kv_cache_memory=400_000)
    from kvlab.plan.capacity import cache_formats
    spec = stories_model.config.to_plan_spec().with_kv_window(WINDOW, SINKS)
    planned = vllm_capacity(spec, 400_000, engine.max_model_len, cache_formats("auto", model_dtype="fp32"), BLOCK,
                            device="cpu", max_num_batched_tokens=engine.config.max_num_batched_tokens)
    assert engine.capacity["log_lines"] == planned["log_lines"]
    assert engine.pool.nbytes() == engine.blocks.num_blocks * BLOCK * 1280
    assert engine.decode_path == "module by module"


@pytest.mark.parametrize("bad", [dict(kv_window=0), dict(sink_tokens=-1, kv_window=8), dict(sink_tokens=4),
                                 dict(kv_window=8, speculative_config={"method": "ngram",
                                                                       "num_speculative_tokens": 2})])
def test_bad_window_settings_are_one_line_errors(stories_model, stories_tokenizer, bad):
    with pytest.raises(RequestError):
        make_engine(stories_model, stories_tokenizer, **bad)
