"""Speculative decoding: the exact acceptance rule on toy distributions, and greedy equality in the engine."""

import pytest
import torch

from engine_helpers import PROMPTS, assert_outputs_match, assert_pool_free, collect, greedy, make_engine, reference, \
    run_all
from kvlab.engine.errors import RequestError
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.speculative import SpeculativeConfig, accept, ngram_proposal
from needs import STORIES

P = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
Q = torch.tensor([0.30, 0.10, 0.30, 0.05, 0.25])
CHI2_DF4_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, alpha = 0.001
SAMPLED = SamplingParams(temperature=1.0, max_tokens=4)


def emitted_counts(rule, trials: int = 12_000) -> tuple[torch.Tensor, int]:
    """First emitted token's counts when a draft x ~ Q is checked against P by `rule`, and acceptances."""
    gen = torch.Generator().manual_seed(0)
    counts, accepted = torch.zeros(5), 0
    p = torch.stack([P, P])  # one drafted position and the bonus position
    for _ in range(trials):
        x = int(torch.multinomial(Q, 1, generator=gen))
        tokens, n = rule([x], p, Q[None], SAMPLED, gen)
        counts[tokens[0]] += 1
        accepted += n
    return counts, accepted


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def skip_residual(drafts, p, q, params, gen):
    """A deliberately wrong rule: on rejection, draw from p itself instead of norm(max(0, p - q))."""
    x = drafts[0]
    if float(torch.rand((), generator=gen)) < min(1.0, float(p[0, x] / q[0, x])):
        return [x], 1
    return [int(torch.multinomial(p[0], 1, generator=gen))], 0


def test_emitted_tokens_follow_the_target_and_acceptance_is_sum_of_min():
    counts, accepted = emitted_counts(accept)
    assert chi_square(counts, P) < CHI2_DF4_P001
    rate, expected = accepted / 12_000, float(torch.minimum(P, Q).sum())  # 0.55
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / 12_000) ** 0.5


def test_a_rule_without_the_residual_resample_is_caught():
    counts, _ = emitted_counts(skip_residual)
    assert chi_square(counts, P) > CHI2_DF4_P001


def test_greedy_rule_accepts_the_agreeing_prefix_then_takes_the_target_argmax():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    greedy_params = SamplingParams(temperature=0, max_tokens=8)
    assert accept([1, 2, 1], logits, None, greedy_params, None) == ([1, 2, 0], 2)
    assert accept([1, 2, 0], logits, None, greedy_params, None) == ([1, 2, 0, 1], 3)  # all agree: bonus
    assert accept([2], logits[:2], None, greedy_params, None) == ([1], 0)


def test_ngram_proposal_follows_the_latest_earlier_match():
    assert ngram_proposal([1, 2, 3, 4, 9, 1, 2, 3], 2, 1, 3) == [4, 9]
    assert ngram_proposal([5, 6, 7], 3, 1, 3) == []
    assert ngram_proposal([1, 2, 1, 3, 1], 2, 1, 2) == [3, 1]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "self", "num_speculative_tokens": 2, "num_layers": 3},
    {"method": "draft_model", "model": str(STORIES), "num_speculative_tokens": 4},
], ids=lambda s: s["method"])
def test_greedy_output_with_speculation_is_the_output_without(stories_model, stories_tokenizer, spec):
    model, tok = stories_model, stories_tokenizer
    engine = make_engine(model, tok, speculative_config=spec, block_size=8, max_num_batched_tokens=32)
    alone = engine.add_request(PROMPTS[0], greedy(40))  # batch 1 first
    got = run_all(engine)
    assert_outputs_match(model, tok, {alone.request_id: (PROMPTS[0], reference(model, tok, PROMPTS[0], 40))}, got)
    wanted = {}
    for i, prompt in enumerate(PROMPTS[1:5]):  # then a mixed batch: prompts chunked beside speculative decodes
        n = 30 + 5 * i
        wanted[engine.add_request(prompt, greedy(n)).request_id] = (prompt, reference(model, tok, prompt, n))
        collect(engine.step(), got)
    run_all(engine, got)
    assert_outputs_match(model, tok, wanted, got)
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    if spec["method"] == "draft_model":  # the target as its own draft: every draft agrees
        assert stats.acceptance_rate == 1.0
    assert_pool_free(engine)  # rolled-back blocks included


def test_sampled_speculation_is_seed_reproducible_and_frees_the_pool(stories_model, stories_tokenizer):
    outs = []
    for _ in range(2):
        engine = make_engine(stories_model, stories_tokenizer, speculative_config={"method": "ngram"})
        seq = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.8, max_tokens=30, seed=11))
        run_all(engine)
        outs.append(seq.output_ids)
        assert len(seq.output_ids) == 30 or seq.finish_reason == "stop"
        assert_pool_free(engine)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("bad", ['{"method": "tree"}', '{"method": "medusa"}', '{"method": "ngram", "num_speculative_tokens": 0}',
                                 '{"method": "draft_model"}', '{"method": "ngram", "k": 3}', "not json", "[1]"])
def test_bad_speculative_configs_are_one_line_errors(bad):
    with pytest.raises(RequestError) as caught:
        SpeculativeConfig.parse(bad)
    assert "\n" not in str(caught.value)


def test_draft_pool_blocks_equal_kvlab_plan_draft(stories_model, stories_tokenizer, capsys):
    """One block holds both models' K/V: the engine's pool and `kvlab plan --draft` agree on its blocks."""
    import json

    from kvlab.cli import main

    engine = make_engine(stories_model, stories_tokenizer, kv_cache_memory=1_000_000, block_size=16,
                         speculative_config={"method": "draft_model", "model": str(STORIES)})
    assert main(["plan", str(STORIES), "--draft", str(STORIES), "--kv-cache-memory", "1000000", "--kv-cache-dtype",
                 "fp32", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    # by hand: 1,280 B/token each, 2 x 20,480 B a block of 16: 1,000,000 // 40,960 = 24 blocks (48 without a draft)
    assert engine.blocks.num_blocks == planned["speculative"]["pool_blocks"] == 24
    assert planned["kv_bytes_per_token"] == 2 * 1280
    assert engine.pool.nbytes() + engine.runner.draft_pool.nbytes() == 24 * 40_960


def test_expected_speedup_is_the_papers_formula():
    from kvlab.plan.speculative import expected_speedup, expected_tokens_per_step

    assert expected_tokens_per_step(0.5, 3) == 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens_per_step(1.0, 4) == 5
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    # a verification that costs 1.8 plain steps (k + 1 rows on a CPU) divides the same tokens by more
    assert expected_speedup(0.8, 4, 0.05, verify_cost=1.8) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 2.0))


def test_acceptance_needed_inverts_the_expected_speedup():
    from kvlab.plan.speculative import acceptance_needed, expected_speedup

    a = acceptance_needed(1.5, 3, 0.1, verify_cost=1.4)
    assert expected_speedup(a, 3, 0.1, verify_cost=1.4) == pytest.approx(1.5, abs=1e-9)
    assert expected_speedup(a - 1e-3, 3, 0.1, verify_cost=1.4) < 1.5
    # by hand, k = 1 and a free draft: (1 + a) / v = 1.5 at v = 1.2 means a = 0.8
    assert acceptance_needed(1.5, 1, 0.0, verify_cost=1.2) == pytest.approx(0.8, abs=1e-9)
    # even always accepted, 2 tokens per step over a cost of 1.5 is 1.33x: out of reach
    assert acceptance_needed(1.5, 1, 0.0, verify_cost=1.5) is None
    assert acceptance_needed(1.0, 2, 0.0) == 0.0  # a free draft and a free verification never lose


def test_blocks_filled_by_accepted_drafts_are_named_from_their_own_tokens(stories_model, stories_tokenizer):
    """Accepted drafts advance num_computed before they are appended; every block the prefix
    cache names must hold a full block of the tokens the sequence really has there."""
    engine = make_engine(stories_model, stories_tokenizer, block_size=4,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    seq = engine.add_request("Once upon a time, once upon a time, once upon a", greedy(200, ignore_eos=True))
    named = 0
    while engine.has_unfinished():
        engine.step()
        ids = seq.all_ids
        for b, block_id in enumerate(seq.block_table):
            block = engine.blocks.blocks[block_id]
            if block.hash is not None and block.ref_count:
                assert block.token_ids == tuple(ids[4 * b:4 * b + 4])
                named += 1
    assert named and engine.runner.spec_stats.num_accepted_tokens > 0
    assert_pool_free(engine)


def test_plan_divides_by_the_verification_cost_it_is_given(capsys):
    import json

    from kvlab.cli import main
    from kvlab.plan.speculative import expected_speedup

    argv = ["plan", "smollm2-135m", "--draft", "smollm2-135m", "--acceptance-rate", "0.6", "--num-speculative-tokens",
            "2", "--kv-cache-memory", "1000000000", "--json"]
    results = []
    for extra in ([], ["--verify-cost", "1.8"]):
        assert main(argv + extra) == 0
        results.append(json.loads(capsys.readouterr().out)["speculative"])
    weight_bound, measured = results
    assert weight_bound["verify_cost"] == 1.0 and measured["verify_cost"] == 1.8
    assert weight_bound["cost_ratio"] == measured["cost_ratio"] == 1.0  # the target as its own draft
    assert measured["expected_speedup"] == expected_speedup(0.6, 2, 1.0, 1.8) == pytest.approx(1.96 / 3.8)
    assert weight_bound["expected_speedup"] == pytest.approx(1.96 / 3.0)


@pytest.mark.parametrize("flags,message", [
    (["--draft", "smollm2-135m", "--acceptance-rate", "0.5", "--verify-cost", "0"], "--verify-cost must be positive"),
    (["--verify-cost", "1.5"], "--verify-cost needs --draft MODEL and --acceptance-rate"),
])
def test_plan_verify_cost_mistakes_are_one_line(flags, message, capsys):
    from kvlab.cli import main

    assert main(["plan", "smollm2-135m", "--kv-cache-memory", "1000000000"] + flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
