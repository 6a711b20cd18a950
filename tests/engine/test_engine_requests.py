"""Admission, aborts, prefix caching, stop conditions and sampling through the engine."""

import pytest
import torch

from engine_helpers import PROMPTS, assert_pool_free, greedy, make_engine, reference, run_all
from kvlab.engine import SamplingParams
from kvlab.engine.errors import RequestError


def test_requests_that_can_never_fit_are_refused(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer, kv_cache_memory=20_480 * 4, max_model_len=200)
    with pytest.raises(RequestError, match="maximum context length is 200"):
        engine.add_request("Once upon a time", greedy(300))
    with pytest.raises(RequestError, match="whole pool has 4"):
        engine.add_request("Once upon a time", greedy(100))  # 4 blocks of 16 hold 64 tokens
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], greedy(3))
    with pytest.raises(RequestError, match="token ids must be in"):
        engine.add_request([1, 10_000], greedy(3))
    assert_pool_free(engine)


def test_abort_frees_blocks_wherever_the_request_is(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer, max_num_seqs=2)
    ids = [engine.add_request(p, greedy(30)).request_id for p in PROMPTS[:4]]
    for _ in range(4):
        engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 2
    engine.abort(ids[0])  # running
    engine.abort(ids[3])  # waiting
    engine.abort("no-such-request")
    got = run_all(engine)
    assert ids[1] in got and ids[2] in got
    assert_pool_free(engine)


def test_prefix_cache_serves_a_shared_prompt_and_keeps_outputs(stories_model, stories_tokenizer):
    model, tok = stories_model, stories_tokenizer
    system = "Once upon a time there was a little girl named Lily. She loved to play in the park with her dog. "
    engine = make_engine(model, tok, block_size=8)
    first = engine.add_request(system + "One day", greedy(12))
    run_all(engine)
    queries, hits = engine.blocks.prefix_queries, engine.blocks.prefix_hits
    assert hits == 0
    second = engine.add_request(system + "The sun", greedy(12))
    got = run_all(engine)
    shared = len(tok.encode(system + "One day"))  # the block-aligned common prefix is served
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_ids, second.prompt_ids)) if a != b)
    assert second.num_cached_prompt == common // 8 * 8 > 0
    assert engine.blocks.prefix_hits - hits == second.num_cached_prompt
    assert engine.blocks.prefix_queries - queries == len(second.prompt_ids)
    assert got[second.request_id] == reference(model, tok, system + "The sun", 12)
    assert shared > common
    assert_pool_free(engine)
    assert engine.reset_prefix_cache() > 0  # the shared blocks, and the two requests' own
    third = engine.add_request(system + "The sun", greedy(12))
    assert run_all(engine)[third.request_id] == got[second.request_id]
    assert third.num_cached_prompt == 0 and engine.reset_prefix_cache() > 0
    assert engine.reset_prefix_cache() == 0
    assert_pool_free(engine)


def test_stop_strings_stop_tokens_and_length(stories_model, stories_tokenizer):
    model, tok = stories_model, stories_tokenizer
    full = tok.decode(reference(model, tok, "Once upon a time", 40))
    engine = make_engine(model, tok)
    texts = {}
    a = engine.add_request("Once upon a time", greedy(40, stop=["little girl"]))
    b = engine.add_request("Once upon a time", greedy(7))
    ref_ids = reference(model, tok, "Once upon a time", 40)
    c = engine.add_request("Once upon a time", greedy(40, stop_token_ids=[ref_ids[3]]))
    for delta in engine.run_until_done():
        texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
    assert texts[a.request_id] == full[:full.index("little girl")] and a.finish_reason == "stop"
    assert b.finish_reason == "length" and len(b.output_ids) == 7
    assert c.finish_reason == "stop" and c.output_ids == ref_ids[:4]
    assert_pool_free(engine)


def test_seeded_sampling_is_reproducible_and_logprobs_are_returned(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer)
    params = dict(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, max_tokens=20, seed=7, logprobs=3)
    a = engine.add_request("Once upon a time", SamplingParams(**params))
    engine.add_request("The cat", SamplingParams(temperature=1.0, max_tokens=20))  # a neighbour drawing too
    run_all(engine)
    alone = make_engine(stories_model, stories_tokenizer)
    b = alone.add_request("Once upon a time", SamplingParams(**params))
    run_all(alone)
    assert a.output_ids == b.output_ids  # its own generator: the batch it ran in does not matter
    assert len(a.logprobs) == 20 and all(len(s.top_logprobs) == 3 and s.logprob <= 0 for s in a.logprobs)
    assert all(s.top_logprobs[0][1] >= s.logprob for s in a.logprobs)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0),
                                 dict(top_k=-2), dict(min_p=2), dict(logprobs=99), dict(stop=[""]),
                                 dict(temperature=float("nan")), dict(seed=2**64), dict(seed=-2**63 - 1)])
def test_bad_sampling_params_name_the_field(bad):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**bad)
    assert caught.value.param == next(iter(bad))


def test_tiny_temperatures_are_greedy(stories_model, stories_tokenizer):
    """vLLM's rule: under 1e-5 is greedy; dividing logits by 1e-40 would give inf and a NaN draw (once a 500)."""
    engine = make_engine(stories_model, stories_tokenizer)
    tiny = engine.add_request("Once upon a time", SamplingParams(temperature=1e-40, max_tokens=8))
    zero = engine.add_request("Once upon a time", greedy(8))
    run_all(engine)
    assert tiny.output_ids == zero.output_ids and tiny.finish_reason == "length"


def test_a_failing_model_step_fails_its_requests_and_frees_their_blocks(stories_model, stories_tokenizer,
                                                                         monkeypatch):
    engine = make_engine(stories_model, stories_tokenizer)
    seq = engine.add_request("Once upon a time", greedy(5))
    original = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda step: (_ for _ in ()).throw(RuntimeError("boom")))
    deltas = engine.step()
    assert deltas[0].finished and deltas[0].finish_reason == "abort" and "boom" in deltas[0].error
    assert seq.finished
    assert_pool_free(engine)
    monkeypatch.setattr(engine.runner, "run", original)
    nxt = engine.add_request("Once upon a time", greedy(5))
    run_all(engine)
    assert nxt.finish_reason == "length"


def test_long_prompt_is_chunked_while_others_decode(stories_model, stories_tokenizer):
    """Decode-first chunked prefill: a decoding request gets a token every step a long prompt is read."""
    engine = make_engine(stories_model, stories_tokenizer, max_num_batched_tokens=16)
    short = engine.add_request("Once upon a time", greedy(30))
    for _ in range(3):
        engine.step()
    long_prompt = " ".join(["The little dog ran to the big tree and back."] * 12)
    late = engine.add_request(long_prompt, greedy(3))
    steps_reading = 0
    while late.first_token_time is None:
        before = len(short.output_ids)
        with torch.inference_mode():
            engine.step()
        steps_reading += 1
        assert len(short.output_ids) == before + 1 or short.finished
    assert steps_reading >= len(late.prompt_ids) // 16  # the prompt came in chunks of at most 16 tokens
    run_all(engine)
    assert_pool_free(engine)


def test_a_request_that_fails_inside_the_model_fails_alone(stories_model, stories_tokenizer, monkeypatch):
    """One poisoned request in a batch: the step is retried one sequence at a time, the others go on."""
    engine = make_engine(stories_model, stories_tokenizer)
    good = [engine.add_request("Once upon a time", greedy(6)) for _ in range(2)]
    original = engine.runner.run

    def poisoned(step):
        if any(seq.request_id == "bad" for seq in step.seqs):
            raise RuntimeError("boom")
        return original(step)
    engine.step()
    monkeypatch.setattr(engine.runner, "run", poisoned)
    bad = engine.add_request("The cat", greedy(6), request_id="bad")
    deltas = engine.step()
    assert [d.request_id for d in deltas if d.error] == ["bad"] and bad.finished
    run_all(engine)
    assert [seq.finish_reason for seq in good] == ["length", "length"]
    reference = make_engine(stories_model, stories_tokenizer)
    ref = reference.add_request("Once upon a time", greedy(6))
    run_all(reference)
    assert good[0].output_ids == good[1].output_ids == ref.output_ids
    assert_pool_free(engine)
