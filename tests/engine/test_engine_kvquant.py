"""KVQuant (and pre-RoPE int4) through the engine: greedy tokens equal the lab's own KVQuantCache
(kvlab.cache.kvquant: pre-RoPE keys rotated on read, the sink in fp16, the key outliers' pool) decoding each
prompt alone, with requests joining mid-flight, preemption (a pool too small for all of them, so sequences are
recomputed in other chunks) and prefix caching asked for; the pool's bytes are the plan's blocks, seats and fixed
bytes, and it is free afterwards.

stories260K (a real GQA Llama) with a calibration fitted on its own activations by `kvlab calibrate-kv`'s code.
"""

from __future__ import annotations

import pytest

from engine_helpers import PROMPTS, assert_pool_free, collect, greedy, make_engine, run_all
from kvlab.cache.kvquant import make_kvquant_cache
from kvlab.cache.kvquant_calibration import save_calibration
from kvlab.engine.errors import RequestError
from kvlab.nn.generate import generate
from kvlab.plan.capacity import cache_formats, kv_fixed_bytes
from kvlab.plan.pool_capacity import kvquant_block_bytes, kvquant_seat_bytes

TEXT = " ".join(PROMPTS) * 8


@pytest.fixture(scope="module")
def calibration_file(stories_model, stories_tokenizer, tmp_path_factory):
    from kvlab.evals.calibrate import calibrate

    ids = stories_tokenizer.encode(TEXT, add_bos=False)
    cal = calibrate(stories_model, ids, context=64, windows=2, sensitivity=False)
    path = tmp_path_factory.mktemp("kvquant") / "stories.kvquant.safetensors"
    save_calibration(cal, path)
    return cal, str(path)


def lab_reference(model, tokenizer, cal, prompt: str, n: int, kv_cache_dtype: str) -> list[int]:
    """The lab's path: the prompt alone through a KVQuantCache (grown in one piece, then a token a step)."""
    ids = tokenizer.encode(prompt)
    cache = make_kvquant_cache(kv_cache_dtype, cal, 1, len(ids) + n, model.dtype, model.layer_ropes())
    return generate(model, ids, n, stop_ids=[tokenizer.eos_id], cache=cache)[0].tolist()


@pytest.mark.parametrize("kv_cache_dtype", ["kvquant4", "kvquant3"])
def test_engine_equals_the_lab_cache_with_joins_preemption_and_prefix_caching(stories_model, stories_tokenizer,
                                                                             calibration_file, kv_cache_dtype):
    model, tok = stories_model, stories_tokenizer
    cal, path = calibration_file
    spec, formats = model.config.to_plan_spec(), cache_formats(kv_cache_dtype, model_dtype="fp32")
    block, seats = kvquant_block_bytes(spec, formats, 8), 4
    memory = 11 * block + seats * kvquant_seat_bytes(spec, formats, model.config.max_seq_len) + \
        kv_fixed_bytes(spec, formats)
    engine = make_engine(model, tok, kv_cache_dtype=kv_cache_dtype, block_size=8, max_num_batched_tokens=24,
                         max_num_seqs=seats, kv_cache_memory=memory, kv_calibration=path)
    assert engine.blocks.num_blocks == 11 and engine.pool.nbytes() == memory  # 88 tokens: not all four at once
    assert engine.decode_path == "module by module"
    work = list(zip(PROMPTS[:4], [40, 25, 33, 50]))
    wanted, got = {}, {}
    for i, (prompt, n) in enumerate(work):
        wanted[engine.add_request(prompt, greedy(n)).request_id] = lab_reference(model, tok, cal, prompt, n,
                                                                                 kv_cache_dtype)
        for _ in range(3 * i):
            collect(engine.step(), got)  # later requests join mid-flight
    run_all(engine, got)
    assert got == wanted
    assert engine.scheduler.num_preemptions > 0
    assert_pool_free(engine)
    assert sorted(engine.blocks.free_seats) == list(range(seats))


def test_a_shared_prompt_is_computed_again_not_read_from_another_seat(stories_model, stories_tokenizer,
                                                                      calibration_file):
    """A KVQuant prefix's sink and key outliers live in the seat of the sequence that computed it, so the
    engine does not share prefixes: two requests with one prompt both compute it, and answer alike."""
    model, tok = stories_model, stories_tokenizer
    cal, path = calibration_file
    engine = make_engine(model, tok, kv_cache_dtype="kvquant4", block_size=8, kv_calibration=path,
                         kv_cache_memory=2_000_000)
    prompt = PROMPTS[2]
    first = engine.add_request(prompt, greedy(20))
    run_all(engine)
    second = engine.add_request(prompt, greedy(20))
    run_all(engine)
    assert second.num_cached_prompt == 0
    assert first.output_ids == second.output_ids == lab_reference(model, tok, cal, prompt, 20, "kvquant4")
    assert_pool_free(engine)


def test_without_a_calibration_the_engine_says_what_to_do(stories_model, stories_tokenizer, tmp_path):
    with pytest.raises(RequestError, match="needs a KVQuant calibration: give --kv-calibration"):
        make_engine(stories_model, stories_tokenizer, kv_cache_dtype="kvquant4")
    with pytest.raises(Exception, match="no KVQuant calibration at"):
        make_engine(stories_model, stories_tokenizer, kv_cache_dtype="kvquant4",
                    kv_calibration=str(tmp_path / "missing.safetensors"))


def test_kvquant_with_sink_tokens_or_another_models_calibration_is_refused_in_one_line(stories_model, stories_tokenizer,
                                                                                    calibration_file, tmp_path):
    from kvquant_helpers import random_calibration
    from kvlab.errors import KvlabError
    from kvlab.nn.config import ModelConfig

    _, path = calibration_file
    with pytest.raises(RequestError, match="--sink-tokens is not supported"):
        make_engine(stories_model, stories_tokenizer, kv_cache_dtype="kvquant4", kv_calibration=path, kv_window=32,
                    sink_tokens=4)
    other = tmp_path / "other.safetensors"
    save_calibration(random_calibration(ModelConfig(vocab_size=32, n_layers=2, dim=32, n_heads=4, n_kv_heads=2)), other)
    with pytest.raises(KvlabError, match="was calibrated for 2 layers"):
        make_engine(stories_model, stories_tokenizer, kv_cache_dtype="kvquant4", kv_calibration=str(other))


def test_pre_rope_int4_equals_the_lab_cache(stories_model, stories_tokenizer):
    """`kvlab eval --pre-rope-keys`'s int4 (the real-models report's int4+prerope row) through the engine: keys
    stored before RoPE in int4 rows and rotated once read, as the lab's pre-RoPE cache does; no C step."""
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok, kv_cache_dtype="int4", pre_rope_keys=True, block_size=8,
                         max_num_batched_tokens=24, kv_cache_memory=11 * 8 * 5 * 4 * 2 * 8, paged_step=True)
    assert engine.pool.pre_rope and engine.decode_path == "module by module"
    work = list(zip(PROMPTS[:4], [40, 25, 33, 50]))
    wanted, got = {}, {}
    for i, (prompt, n) in enumerate(work):
        ids = tok.encode(prompt)
        cache = model.new_cache(1, len(ids) + n, "int4", pre_rope=True)
        want = generate(model, ids, n, stop_ids=[tok.eos_id], cache=cache)[0].tolist()
        wanted[engine.add_request(prompt, greedy(n)).request_id] = want
        for _ in range(3 * i):
            collect(engine.step(), got)
    run_all(engine, got)
    assert got == wanted
    assert engine.scheduler.num_preemptions > 0
    assert_pool_free(engine)
