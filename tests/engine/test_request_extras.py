"""vLLM's request extras in the engine: n, prompt log-probabilities, penalties, logit_bias, min_tokens, grammars."""

import json

import pytest
import torch

from engine_helpers import PROMPTS, assert_pool_free, greedy, make_engine, reference, run_all
from kvlab.engine import SamplingParams
from kvlab.engine.errors import RequestError
from kvlab.engine.logits_process import penalise
from kvlab.engine.structured import StructuredOutputsParams
from needs import require_module

LONG = "Once upon a time there was a little girl named Lily. She loved to play in the park with her dog every day"


def test_penalties_are_vllms_arithmetic():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0])
    penalise(row, prompt_ids=[0], output_ids=[1, 1, 3], presence=0.5, frequency=0.25, repetition=2.0)
    # repetition over prompt and output tokens {0, 1, 3}: positive / 2, negative * 2; then output counts
    # (token 1 twice, token 3 once) times 0.25, and 0.5 for each token seen in the output
    assert row.tolist() == [1.0, -4.0 - 0.5 - 0.5, 1.0, 0.25 - 0.25 - 0.5, -1.0]


def test_sampling_params_take_vllms_fields_and_name_bad_ones():
    params = SamplingParams(n=2, presence_penalty=1, logit_bias={"5": 2}, min_tokens=1,
                            guided_decoding=StructuredOutputsParams(choice=["a"]))
    assert params.logit_bias == {5: 2.0} and params.structured_outputs.choice == ["a"] and params.processed
    assert not SamplingParams().processed
    for kwargs, param in [({"n": 0}, "n"), ({"n": 65}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                          ({"logit_bias": {1: 101}}, "logit_bias"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                          ({"prompt_logprobs": 21}, "prompt_logprobs")]:
        with pytest.raises(RequestError) as error:
            SamplingParams(**kwargs)
        assert error.value.param == param
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")


def test_n_samples_share_the_prompt_blocks_and_seed_plus_i(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer, block_size=8)
    seqs = engine.add_samples(LONG, SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True))
    assert [s.request_id for s in seqs][1].startswith("1_") and engine.num_waiting == 3
    got = run_all(engine)
    full_blocks = (len(seqs[0].prompt_ids) - 1) // 8
    assert [s.num_cached_prompt for s in seqs] == [0] + [full_blocks * 8] * 2  # siblings read the first's blocks
    assert_pool_free(engine)
    for i, seq in enumerate(seqs):  # each sample is the request with seed + i, alone
        alone = make_engine(stories_model, stories_tokenizer, block_size=8)
        single = alone.add_request(LONG, SamplingParams(temperature=0.9, seed=7 + i, max_tokens=12, ignore_eos=True))
        assert run_all(alone)[single.request_id] == got[seq.request_id]


def test_aborting_held_samples_frees_everything(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer, block_size=8)
    seqs = engine.add_samples(LONG, SamplingParams(n=3, max_tokens=5))
    engine.abort(seqs[2].request_id)  # held, never scheduled
    engine.step()
    engine.abort(seqs[0].request_id)
    got = run_all(engine)
    assert list(got) == [seqs[1].request_id]
    assert_pool_free(engine)


def test_prompt_logprobs_equal_the_models_log_softmax(stories_model, stories_tokenizer):
    engine = make_engine(stories_model, stories_tokenizer, block_size=8, max_num_batched_tokens=7)  # chunked
    warm = engine.add_request(LONG, greedy(1))  # its blocks enter the prefix cache, which the next must skip
    run_all(engine)
    seq = engine.add_request(LONG, greedy(1, prompt_logprobs=2))
    run_all(engine)
    ids = seq.prompt_ids
    with torch.inference_mode():
        logits = stories_model(torch.tensor([ids]), stories_model.new_cache(1, len(ids)))[0]
    want = torch.log_softmax(logits.float(), dim=-1)
    assert seq.prompt_logprobs[0] is None and seq.num_cached_prompt == 0 and warm.num_cached_prompt == 0
    for p in range(1, len(ids)):
        entry = seq.prompt_logprobs[p]
        assert entry.token_id == ids[p]
        assert entry.logprob == pytest.approx(float(want[p - 1, ids[p]]), abs=1e-4)
        assert entry.rank == int((want[p - 1] > want[p - 1, ids[p]]).sum()) + 1
        assert [t for t, _ in entry.top_logprobs] == torch.topk(want[p - 1], 2).indices.tolist()


def test_logit_bias_min_tokens_and_penalties_change_only_their_own_rows(stories_model, stories_tokenizer):
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok)
    plain = [engine.add_request(p, greedy(10)) for p in PROMPTS[:3]]
    first = reference(model, tok, PROMPTS[0], 10)
    forced = engine.add_request(PROMPTS[0], greedy(6, logit_bias={first[1]: 100.0}))
    banned = engine.add_request(PROMPTS[0], greedy(6, logit_bias={first[0]: -100.0}))
    early = engine.add_request(PROMPTS[0], greedy(6, stop_token_ids=[first[0]], min_tokens=3))
    penalised = engine.add_request(PROMPTS[0], greedy(40, frequency_penalty=2.0, presence_penalty=2.0,
                                                      repetition_penalty=1.5))
    got = run_all(engine)
    for seq, prompt in zip(plain, PROMPTS):  # batched with the processed rows, still kvlab generate's tokens
        assert got[seq.request_id] == reference(model, tok, prompt, 10)
    assert got[forced.request_id] == [first[1]] * 6
    assert got[banned.request_id][0] != first[0]
    assert len(got[early.request_id]) >= 3 and first[0] not in got[early.request_id][:3]
    unpenalised = reference(model, tok, PROMPTS[0], 40)  # repeats token 426 at its 27th token; penalised, not
    assert got[penalised.request_id][:26] == unpenalised[:26] and got[penalised.request_id][26] != unpenalised[26]
    assert_pool_free(engine)


@pytest.mark.parametrize("constraint,check", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
                                   "additionalProperties": False}, disable_any_whitespace=True),
     lambda text: isinstance(json.loads(text)["n"], int)),
    (StructuredOutputsParams(choice=["yes", "no"]), lambda text: text in ("yes", "no")),
    (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
     lambda text: len(text) == 6 and text[:3].isdigit() and text[3] == "-"),
])
def test_grammars_hold_in_a_batch_with_free_requests(stories_model, stories_tokenizer, constraint, check):
    require_module("llguidance")
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok)
    free = engine.add_request(PROMPTS[1], greedy(10))
    seqs = [engine.add_request(p, SamplingParams(temperature=t, seed=1, max_tokens=40, structured_outputs=constraint))
            for p, t in zip(PROMPTS[:3], (0, 0.8, 1.0))]
    run_all(engine)
    for seq in seqs:
        text = tok.decode(seq.output_ids)
        assert seq.finish_reason == "stop" and check(text), text
    assert free.output_ids == reference(model, tok, PROMPTS[1], 10)
    assert not engine.logits_processor.tracked  # every matcher dropped with its request
    assert_pool_free(engine)


def test_invalid_grammars_and_unsupported_combinations_are_refused(stories_model, stories_tokenizer):
    require_module("llguidance")
    engine = make_engine(stories_model, stories_tokenizer)
    with pytest.raises(RequestError, match="not a valid constraint"):
        engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("x", SamplingParams(logit_bias={10_000: 1}))
    with pytest.raises(RequestError, match="add_samples"):
        engine.add_request("x", SamplingParams(n=2))
    spec = make_engine(stories_model, stories_tokenizer, speculative_config={"method": "ngram",
                                                                             "num_speculative_tokens": 2})
    with pytest.raises(RequestError, match="speculative"):
        spec.add_request("x", SamplingParams(presence_penalty=1.0))
    assert_pool_free(engine)


def test_llm_generate_takes_vllms_options():
    """`LLM.generate` with SamplingParams(n=..., structured_outputs=..., prompt_logprobs=...), as in vLLM."""
    require_module("llguidance")
    from kvlab import LLM
    from needs import STORIES

    llm = LLM(str(STORIES), kv_cache_memory=400_000, block_size=8)
    out = llm.generate([LONG, "One day"], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6,
                                                         prompt_logprobs=1))
    assert [len(o.outputs) for o in out] == [2, 2] and [c.index for c in out[0].outputs] == [0, 1]
    assert out[0].request_id.startswith("req-") and out[0].prompt_logprobs[0] is None
    assert len(out[0].prompt_logprobs) == len(out[0].prompt_token_ids)
    picked = llm.generate("The cat", SamplingParams(max_tokens=5, guided_decoding=StructuredOutputsParams(
        choice=["sat", "ran"])))
    assert picked[0].outputs[0].text in ("sat", "ran")
