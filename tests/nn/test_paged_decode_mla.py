"""The C step's MLA layers (csrc/mla_attend.h): absorbed attention over the pool's latent rows decodes
what the module path (kvlab.nn.mla) decodes, for kvlab's exact conversion of a GQA model at full rank
(every key channel rotated: the scores read only the RoPE keys), a truncated one (position-free key
channels folded into the query through W_uk), and a DeepSeek-shaped model (one shared RoPE key, a
latent norm); a broken descriptor is refused or shows in the logits.

Tiny random models with 32-multiple widths, Q8_0-packed: stories260K's 172-wide MLP does not pack
into 32-value blocks, so its conversions run module by module.
"""

import copy

import pytest
import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.checkpoints.mla import convert_to_mla
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.nn.pack import pack_q8_0
from kvlab.nn.paged_decode import PagedDecodeStep, why_not_paged
from test_c_model import assert_close_to_scale

from needs import STORIES, require_file, require_kernels

BLOCK = 8
LENGTHS = [3, 17, 130, 200]  # inside a block, across blocks, past one and one and a half 128-token chunks
SOURCE = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                     max_seq_len=256, tie_embeddings=True, name="tiny-gqa")
DEEPSEEK = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=6, attention="mla", kv_lora_rank=24,
                       qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, ffn_dim=96, max_seq_len=256,
                       name="tiny-deepseek")


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


def mla_model(kind: str) -> Decoder:
    """A dense MLA model: "full" (kvlab layout, full rank, rope = head dim), "truncated" (rank 16 of 48,
    8 RoPE channels of 16) or "deepseek" (random, latent norm away from 1)."""
    torch.manual_seed(0)
    if kind == "deepseek":
        model = Decoder(DEEPSEEK).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
        return model
    source = Decoder(SOURCE).eval()
    return convert_to_mla(source, 32, 16).model if kind == "full" else convert_to_mla(source, 16, 8).model


def filled_pool(model: Decoder, kv_cache_dtype: str = "auto"):
    """A latent pool holding each row's first LENGTHS[r] tokens (written by the module path), shuffled blocks."""
    per_row = max(LENGTHS) // BLOCK + 3
    pool = KVPool.for_model(model.config, len(LENGTHS) * per_row + 2, BLOCK, kv_cache_dtype)
    order = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [[order[r * per_row:(r + 1) * per_row] for r in range(len(LENGTHS))]]
    tokens = torch.randint(0, 96, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(tokens, pool, last_only=True, step=StepBatch.build([0] * len(LENGTHS), LENGTHS, block_size=BLOCK,
                                                                  group_tables=tables))
    return pool, tables


def decode_both(model: Decoder, pool: KVPool, tables, step: PagedDecodeStep, steps: int = 2):
    """`steps` decode steps in C and on a copy of the pool module by module: each step's (C, module) logits."""
    reference = copy.deepcopy(pool)
    ids = torch.randint(0, 96, (len(LENGTHS),), generator=torch.Generator().manual_seed(5))
    out = []
    for index in range(steps):
        batch = StepBatch.build([n + index for n in LENGTHS], [1] * len(LENGTHS), block_size=BLOCK,
                                group_tables=tables)
        with torch.inference_mode():
            expected = model(ids[None], reference, last_only=True, step=batch)[0]
        out.append((step(ids, batch), expected))
        ids = expected.argmax(-1)
    return out


@pytest.mark.parametrize("kind", ["full", "truncated", "deepseek"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "fp8"])
def test_mla_decode_in_c_equals_the_module_path(kind, kv_cache_dtype):
    model = pack_q8_0(mla_model(kind))
    pool, tables = filled_pool(model, kv_cache_dtype)
    assert pool.is_latent and why_not_paged(model, pool) is None
    step = PagedDecodeStep(model, pool, max_rows=len(LENGTHS))
    for got, expected in decode_both(model, pool, tables, step):
        assert_close_to_scale(got, expected, "int16")
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_c_step_writes_the_latent_rows_the_module_path_writes():
    model = pack_q8_0(mla_model("deepseek"))
    pool, tables = filled_pool(model, "fp16")
    reference = copy.deepcopy(pool)
    batch = StepBatch.build(LENGTHS, [1] * len(LENGTHS), block_size=BLOCK, group_tables=tables)
    ids = torch.tensor([4, 5, 6, 7])
    PagedDecodeStep(model, pool, len(LENGTHS))(ids, batch)
    with torch.inference_mode():
        model(ids[None], reference, last_only=True, step=batch)
    for layer in range(model.config.n_layers):
        for r, n in enumerate(LENGTHS):
            block, offset = tables[0][r][n // BLOCK], n % BLOCK
            got, want = pool.k[layer]["x"][block, 0, offset].float(), reference.k[layer]["x"][block, 0, offset].float()
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))


def test_prompt_rows_in_c_equal_the_module_path():
    """`feeds` (a prompt's tokens as rows, each seeing the rows before it in the same call) over latents."""
    model = pack_q8_0(mla_model("truncated"))
    pool = KVPool.for_model(model.config, 8, BLOCK)
    reference = copy.deepcopy(pool)
    tables = [[3, 1, 6], [0, 7]]
    feeds = [list(range(1, 20)), [9, 8, 7, 6, 5]]
    got = PagedDecodeStep(model, pool, 32).feeds(feeds, [0, 0], tables)
    batch = StepBatch.build([0, 0], [19, 5], block_size=BLOCK, group_tables=[tables])
    with torch.inference_mode():
        expected = model(torch.tensor([feeds[0] + feeds[1]]), reference, step=batch)[0]
    assert_close_to_scale(got, expected, "int16")


def test_a_broken_descriptor_is_refused_or_shows():
    model = pack_q8_0(mla_model("deepseek"))
    pool, tables = filled_pool(model)
    batch = StepBatch.build(LENGTHS, [1] * len(LENGTHS), block_size=BLOCK, group_tables=tables)
    ids = torch.tensor([4, 5, 6, 7])
    breaks = [lambda s: setattr(s._struct, "kv_lora_rank", 16),  # the stacked rows no longer add up
              lambda s: setattr(s._struct, "n_kv_heads", 2),
              lambda s: setattr(s._layers[1], "attention", 0),  # one layer GQA in an MLA model
              lambda s: setattr(s._layers[0], "w_uv", None),
              lambda s: setattr(s._layers[0], "w_uk", None),  # nope channels without their W_uk
              lambda s: setattr(s._layers[0], "window", 16)]
    for index, breaking in enumerate(breaks):
        step = PagedDecodeStep(model, copy.deepcopy(pool), len(LENGTHS))
        breaking(step)
        with pytest.raises(ValueError, match="cannot run"):
            step(ids, batch)
    good = PagedDecodeStep(model, copy.deepcopy(pool), len(LENGTHS))(ids, batch)
    step = PagedDecodeStep(model, copy.deepcopy(pool), len(LENGTHS))
    step._layers[0].latent_norm = None  # a field the checks cannot judge: the new latents go in unnormalised
    with pytest.raises(AssertionError):
        assert_close_to_scale(step(ids, batch), good, "int16")


def test_what_the_c_step_does_not_run_says_why():
    dense = mla_model("full")
    pool = KVPool.for_model(dense.config, 4, BLOCK)
    assert "q8_0" in why_not_paged(dense, pool)  # a converted directory loads dense
    model = pack_q8_0(dense)
    assert "latent pools" in why_not_paged(model, KVPool.for_model(model.config, 4, BLOCK, "int8"))
    assert "not this model's" in why_not_paged(model, KVPool.for_model(SOURCE, 4, BLOCK))
    assert "--kv-window" in why_not_paged(model, KVPool.for_model(model.config, 4, BLOCK, kv_window=16))


def test_a_converted_directory_loads_as_q8_0_blocks_and_decodes_in_c(tmp_path):
    """`--weights q8_0` (load_checkpoint(..., "q8_0")) on a safetensors directory: the same blocks
    pack_q8_0 makes of the model in memory, and the C step runs it."""
    from kvlab.checkpoints.hf import save_hf
    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.nn.ggml import GGMLLinear

    dense = mla_model("truncated")
    save_hf(dense, str(tmp_path), None)
    loaded = load_checkpoint(str(tmp_path), packing="q8_0").model
    assert isinstance(loaded.blocks[0].attn.wkv_a, GGMLLinear) and loaded.packing == "gguf"
    assert torch.equal(loaded.blocks[1].attn.o.codes, pack_q8_0(dense).blocks[1].attn.o.codes)
    assert why_not_paged(loaded, KVPool.for_model(loaded.config, 4, BLOCK)) is None


def test_q8_0_refuses_a_model_whose_rows_are_not_32_multiples_in_one_line():
    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.plan.errors import PlanError

    path = require_file(STORIES, "stories260K")
    with pytest.raises(PlanError, match="--weights q8_0: Q8_0 packs rows of a multiple of 32 weights, not 172"):
        load_checkpoint(str(path), packing="q8_0")
