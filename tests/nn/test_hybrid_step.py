"""The hybrid decode step (kvlab.nn.hybrid_step: products in the library, attention in C over the
pool) against the fused C step: the same logits and the same K/V written, on pools prefilled alike.

The hybrid step multiplies the exact dense weights the blocks encode, in fp32 on a CPU without
bf16 hardware; the fused step quantises each product's activations to int16 (or int8) per 32
values first. So the two differ by the fused step's activation rounding: test_c_model.TOLERANCE,
the same bound the fused step is held to against the module path. With a bf16 library copy
(CPUs with AVX-512 BF16 or AMX) each product's inputs lose all but 8 bits of mantissa: about 4e-3
of relative error a product, and BF16_TOLERANCE (3e-2 of the logits' largest) on these models.
"""

import pytest
import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.nn import ggml
from kvlab.nn.config import ModelConfig
from kvlab.nn.hybrid_step import HybridDecodeStep, hybrid_step_for, why_not_hybrid
from kvlab.nn.model import Decoder
from kvlab.nn.pack import pack_q8_0
from kvlab.nn.paged_decode import PagedDecodeStep, why_not_paged
from test_c_model import GQA, TOLERANCE, assert_close_to_scale, ggml_model
from test_paged_decode import assert_pools_agree, one_layer_if_coarse
from test_sliding_layers import tiny_model
from test_paged_decode_feeds import prefilled as prefilled_in_blocks

from needs import require_kernels

from test_paged_decode import BLOCK  # noqa: E402  (5: chunks and blocks out of step)
BF16_TOLERANCE = 3e-2  # of the logits' largest, a bf16 library copy against the fused step (module doc)


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


def prefilled(model, prompt_lens, kv_cache_dtype="auto", seed=0):
    """Two pools holding each sequence's prompt (the module path, the same bytes in both), and the tables,
    in this file's blocks."""
    return prefilled_in_blocks(model, prompt_lens, seed, kv_cache_dtype, BLOCK)


def fed(config, lengths, seed=7):
    return [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed + i)).tolist()
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("config", [GQA, GQA.with_kv_heads(1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16"])
def test_hybrid_step_equals_the_fused_step(config, kv_cache_dtype):
    """Verification rows (several tokens of one sequence, each reading the K/V the rows before it
    wrote in the same layer), a plain decode row: logits and pools."""
    model = ggml_model(config)
    prompt_lens, feed_lens = [3, 7, 5], [4, 1, 6]
    (ours, theirs), tables = prefilled(model, prompt_lens, kv_cache_dtype)
    feeds = fed(config, feed_lens)
    got = HybridDecodeStep(model, ours, max_rows=16).feeds(feeds, prompt_lens, tables)
    want = PagedDecodeStep(model, theirs, max_rows=16).feeds(feeds, prompt_lens, tables)
    assert got.shape == want.shape == (sum(feed_lens), config.vocab_size)
    assert_close_to_scale(got, want)
    assert_pools_agree(ours, theirs, [StepBatch.build(prompt_lens, feed_lens, tables, BLOCK)])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "int2"])
def test_coded_pools_get_the_fused_steps_codes(kv_cache_dtype):
    """One layer, one row per sequence (test_paged_decode.one_layer_if_coarse: deeper, a code that sits on
    a rounding boundary and tips one way in one step moves what later layers read by a step of the grid)."""
    config = one_layer_if_coarse(GQA, "int4")
    model = ggml_model(config)
    prompt_lens = [3, 7, 5, 9]
    (ours, theirs), tables = prefilled(model, prompt_lens, kv_cache_dtype)
    ids = torch.tensor([t[0] for t in fed(config, [1] * 4)])
    batch = StepBatch.build(prompt_lens, [1] * 4, tables, BLOCK)
    got = HybridDecodeStep(model, ours, max_rows=4)(ids, batch)
    want = PagedDecodeStep(model, theirs, max_rows=4)(ids, batch)
    assert_close_to_scale(got, want)
    assert_pools_agree(ours, theirs, [batch])


def test_a_decode_batch_the_logit_rows_and_the_hidden_states():
    model = ggml_model(GQA)
    prompt_lens = [3, 7, 5, 9]
    (ours, theirs), tables = prefilled(model, prompt_lens)
    ids = torch.tensor([t[0] for t in fed(GQA, [1] * 4)])
    batch = StepBatch.build(prompt_lens, [1] * 4, tables, BLOCK)
    hybrid, fused = HybridDecodeStep(model, ours, max_rows=4), PagedDecodeStep(model, theirs, max_rows=4)
    assert_close_to_scale(hybrid(ids, batch), fused(ids, batch))
    feeds, starts = fed(GQA, [3, 2], seed=11), [8, 4]  # past the decode rows just written
    mine, theirs_hidden = torch.empty(5, GQA.dim), torch.empty(5, GQA.dim)
    got = hybrid.feeds(feeds, starts, tables[:2], logit_rows=[2, 4], hidden=mine)
    want = fused.feeds(feeds, starts, tables[:2], logit_rows=[2, 4], hidden=theirs_hidden)
    assert got.shape == (2, GQA.vocab_size)
    assert_close_to_scale(got, want)
    assert_close_to_scale(mine, theirs_hidden)


def test_a_gemma_shaped_model_with_sliding_layers():
    """q/k norms, post-norms, GeGLU, an embedding scale and windows (two KV groups) through the hybrid step."""
    model = pack_q8_0(tiny_model(max_seq_len=64, dim=64, head_dim=32, ffn_dim=96, embed_scale=8.0))
    prompt_lens, feed_lens = [9, 13], [3, 1]
    pools = [KVPool.for_model(model.config, 40, BLOCK) for _ in range(2)]
    assert len(pools[0].groups) > 1
    tables = [[list(range(0, 6)), list(range(6, 12))] for _ in pools[0].groups]
    batch = StepBatch.build([0, 0], prompt_lens, block_size=BLOCK, group_tables=tables)
    tokens = torch.randint(0, model.config.vocab_size, (1, sum(prompt_lens)), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for pool in pools:
            model(tokens, pool, last_only=True, step=batch)
    feeds = fed(model.config, feed_lens)
    got = HybridDecodeStep(model, pools[0], max_rows=8).feeds(feeds, prompt_lens, tables)
    want = PagedDecodeStep(model, pools[1], max_rows=8).feeds(feeds, prompt_lens, tables)
    assert_close_to_scale(got, want)
    fed_batch = StepBatch.build(prompt_lens, feed_lens, block_size=BLOCK, group_tables=tables)
    assert_pools_agree(pools[0], pools[1], [fed_batch])


def test_int8_activations_sit_within_their_own_tolerance():
    model = ggml_model(GQA, activations="int8")
    (ours, theirs), tables = prefilled(model, [5, 6])
    feeds = fed(GQA, [3, 2])
    got = HybridDecodeStep(model, ours, max_rows=8).feeds(feeds, [5, 6], tables)
    want = PagedDecodeStep(model, theirs, max_rows=8).feeds(feeds, [5, 6], tables)
    assert_close_to_scale(got, want, "int8")


def test_a_bf16_library_copy_within_the_stated_tolerance(monkeypatch):
    """What a CPU with AVX-512 BF16 or AMX multiplies (made here on purpose: bf16 products run on any CPU)."""
    monkeypatch.setattr(ggml, "library_dtype", lambda: torch.bfloat16)
    model = ggml_model(GQA, seed=3)  # a model of its own: the copies are made once and kept
    (ours, theirs), tables = prefilled(model, [5, 6, 7])
    feeds = fed(GQA, [4, 1, 3])
    hybrid = HybridDecodeStep(model, ours, max_rows=8)
    hybrid.warm()
    assert model.lm_head.library_weight().dtype == torch.bfloat16
    got = hybrid.feeds(feeds, [5, 6, 7], tables)
    want = PagedDecodeStep(model, theirs, max_rows=8).feeds(feeds, [5, 6, 7], tables)
    torch.testing.assert_close(got, want, rtol=0, atol=BF16_TOLERANCE * want.abs().max().item())
    assert BF16_TOLERANCE > TOLERANCE["int16"]


def test_what_the_hybrid_step_refuses():
    """Dense weights (no C step at all) and an MLA model (its projections run inside C's attention)."""
    assert why_not_hybrid(ggml_model(GQA), KVPool.for_model(GQA, 8, BLOCK)) is None
    assert hybrid_step_for(Decoder(GQA).eval(), KVPool.for_model(GQA, 8, BLOCK), 4) is None
    mla = ModelConfig(vocab_size=96, dim=64, n_layers=1, n_heads=4, attention="mla", kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_seq_len=64, name="mla")
    model = pack_q8_0(Decoder(mla).eval())
    pool = KVPool.for_model(mla, 8, BLOCK)
    assert why_not_paged(model, pool) is None  # the fused step runs it
    assert "grouped-query" in why_not_hybrid(model, pool)
