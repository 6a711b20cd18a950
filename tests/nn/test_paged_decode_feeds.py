"""The C paged step fed several tokens per sequence (speculative verification) and cut to the
first layers (the self-draft), against the module path: logits at every fed position."""

import pytest
import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.nn.paged_decode import PagedDecodeStep
from test_c_model import GQA, assert_close_to_scale, ggml_model

from needs import require_kernels


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


BLOCK = 4


def prefilled(model, prompt_lens, seed=0, kv_cache_dtype="auto", block=BLOCK):
    """Two identical pools holding each sequence's prompt (module path), and the sequences' block tables."""
    pools = [KVPool.for_model(model.config, 40, block, kv_cache_dtype) for _ in range(2)]
    order = torch.randperm(40, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in prompt_lens:
        need = (n + 8) // block + 1
        tables.append(order[at:at + need])
        at += need
    tokens = torch.randint(0, model.config.vocab_size, (1, sum(prompt_lens)), generator=torch.Generator().manual_seed(1))
    batch = StepBatch.build([0] * len(prompt_lens), prompt_lens, tables, block)
    with torch.inference_mode():
        for pool in pools:
            model(tokens, pool, last_only=True, step=batch)
    return pools, tables


@pytest.mark.parametrize("config", [GQA, GQA.with_kv_heads(1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("num_layers", [None, 1])
def test_several_tokens_per_sequence_equal_the_module_path(config, num_layers):
    model = ggml_model(config)
    prompt_lens, feed_lens = [3, 7, 5], [4, 1, 6]  # a verification of 3 drafts, a plain decode, one of 5
    (ours, reference), tables = prefilled(model, prompt_lens)
    feeds = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(7 + i)).tolist()
             for i, n in enumerate(feed_lens)]
    step = PagedDecodeStep(model, ours, max_rows=4, num_layers=num_layers)
    got = step.feeds(feeds, prompt_lens, tables)
    batch = StepBatch.build(prompt_lens, feed_lens, tables, BLOCK)
    with torch.inference_mode():
        want = model(torch.tensor([[t for f in feeds for t in f]]), reference, step=batch,
                     rows=torch.arange(sum(feed_lens)), num_layers=num_layers)[0]
    assert got.shape == want.shape == (sum(feed_lens), config.vocab_size)
    assert_close_to_scale(got, want)
    for layer in range(num_layers or config.n_layers):  # the K/V it wrote are the module path's
        assert_close_to_scale(ours.k[layer]["x"], reference.k[layer]["x"])
    if num_layers:  # layers past the cut are untouched
        torch.testing.assert_close(ours.k[num_layers]["x"], reference.k[num_layers]["x"], rtol=0, atol=0)


def test_prompts_fed_as_rows_give_the_module_paths_logits_for_the_rows_asked():
    """A prompt from position 0, a prompt's second chunk and a decode in one call, with scores for the
    last row of each prompt piece and the decode row only (the engine's mixed step)."""
    model = ggml_model(GQA)
    (ours, reference), tables = prefilled(model, [1, 6, 5])
    starts, feed_lens = [0, 6, 5], [9, 5, 1]  # sequence 0's prompt is fed anew from 0 (the pools' row is overwritten)
    feeds = [torch.randint(0, GQA.vocab_size, (n,), generator=torch.Generator().manual_seed(3 + i)).tolist()
             for i, n in enumerate(feed_lens)]
    wanted = [8, 13, 14]
    got = PagedDecodeStep(model, ours, max_rows=4).feeds(feeds, starts, tables, logit_rows=wanted)
    batch = StepBatch.build(starts, feed_lens, tables, BLOCK)
    with torch.inference_mode():
        want = model(torch.tensor([[t for f in feeds for t in f]]), reference, step=batch,
                     rows=torch.tensor(wanted))[0]
    assert got.shape == want.shape == (3, GQA.vocab_size)
    assert_close_to_scale(got, want)
    for layer in range(GQA.n_layers):
        assert_close_to_scale(ours.k[layer]["x"], reference.k[layer]["x"])
        assert_close_to_scale(ours.v[layer]["x"], reference.v[layer]["x"])


def test_logit_rows_must_be_ascending_rows_of_the_step():
    model = ggml_model(GQA)
    (ours, _), tables = prefilled(model, [3])
    step = PagedDecodeStep(model, ours, max_rows=4)
    for bad in ([1, 0], [0, 2], [4], [-1]):
        with pytest.raises(ValueError, match="outside"):
            step.feeds([[1, 2]], [3], tables, logit_rows=bad)


def test_hidden_states_are_the_module_paths_for_every_row():
    """`hidden` receives every fed row's final hidden state (after the final norm), whichever rows get scores;
    `inputs` replaces the embeddings (an EAGLE head's fused features) and gives the same step."""
    model = ggml_model(GQA)
    (ours, reference), tables = prefilled(model, [3, 6])
    starts, feed_lens = [3, 6], [4, 2]
    feeds = [torch.randint(0, GQA.vocab_size, (n,), generator=torch.Generator().manual_seed(5 + i)).tolist()
             for i, n in enumerate(feed_lens)]
    hidden = torch.empty(sum(feed_lens), GQA.dim)
    step = PagedDecodeStep(model, ours, max_rows=8)
    logits = step.feeds(feeds, starts, tables, logit_rows=[3, 5], hidden=hidden)
    batch = StepBatch.build(starts, feed_lens, tables, BLOCK)
    flat = torch.tensor([[t for f in feeds for t in f]])
    with torch.inference_mode():
        want_logits, want_hidden = model(flat, reference, step=batch, rows=torch.tensor([3, 5]), with_hidden=True)
    assert_close_to_scale(hidden, want_hidden[0])
    assert_close_to_scale(logits, want_logits[0])
    again = torch.empty_like(hidden)
    with torch.inference_mode():
        embedded = model.embed(flat[0]).float()
    step.feeds(feeds, starts, tables, logit_rows=[3, 5], hidden=again, inputs=embedded)
    torch.testing.assert_close(again, hidden, rtol=0, atol=0)
