"""The C step as a program of per-layer descriptors: a Gemma 3-shaped model (sliding and global
layers in KV groups of one pool, q/k norms, post-norms, GeGLU, scaled embeddings, a second RoPE
table, a query scale) decodes in C as the module path does; a wrong descriptor field shows."""

import copy

import pytest
import torch

from kvlab.cache.kv_groups import RELEASED
from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.nn.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvlab.nn.model import Decoder
from kvlab.nn.pack import pack_q8_0
from kvlab.nn.paged_decode import PagedDecodeStep, why_not_paged
from test_c_model import assert_close_to_scale

from needs import require_kernels

WINDOW, BLOCK = 20, 8
TYPES = (SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION)


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


def gemma_model(**changes) -> Decoder:
    fields = dict(vocab_size=96, dim=64, n_layers=4, n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=96, mlp="geglu",
                  norm_eps=1e-6, rope_base=1e6, rope_local_base=1e4, max_seq_len=256, tie_embeddings=True,
                  qk_norm=True, post_norms=True, embed_scale=64 ** 0.5, query_scale=24 ** -0.5,
                  sliding_window=WINDOW, layer_types=TYPES, name="tiny-gemma")
    torch.manual_seed(0)
    model = Decoder(ModelConfig(**{**fields, **changes})).eval()
    with torch.no_grad():  # norms away from 1, so a norm applied twice or not at all shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return pack_q8_0(model)


def fill(model: Decoder, lengths: list[int]):
    """A pool whose groups hold each row's first lengths[r] tokens (module path), tables with the
    sliding groups' blocks before the window released, as the engine leaves them."""
    per_row = max(lengths) // BLOCK + 2
    pool = KVPool.for_model(model.config, len(lengths) * per_row * len(TYPES) + 4, BLOCK)
    order = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [[order[(g * len(lengths) + r) * per_row:(g * len(lengths) + r + 1) * per_row]
               for r in range(len(lengths))] for g in range(len(pool.groups))]
    tokens = torch.randint(0, 96, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    batch = StepBatch.build([0] * len(lengths), lengths, block_size=BLOCK, group_tables=tables)
    with torch.inference_mode():
        model(tokens, pool, last_only=True, step=batch)
    for g, group in enumerate(pool.groups):
        if group.windowed:
            for r, n in enumerate(lengths):
                for b in range(group.first_visible(n) // BLOCK):
                    tables[g][r][b] = RELEASED
    return pool, tables


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16"])
def test_gemma_shaped_decode_in_c_equals_the_module_path(kv_cache_dtype):
    model = gemma_model()
    lengths = [3, 19, 20, 21, 45, 130, 150]  # inside, at and past the window; past a 128-token chunk
    pool, tables = fill(model, lengths)
    assert why_not_paged(model, pool) is None and len(pool.groups) > 1
    reference = copy.deepcopy(pool)
    step = PagedDecodeStep(model, pool, max_rows=len(lengths))
    ids = torch.randint(0, 96, (len(lengths),), generator=torch.Generator().manual_seed(5))
    for index in range(2):
        batch = StepBatch.build([n + index for n in lengths], [1] * len(lengths), block_size=BLOCK,
                                group_tables=tables)
        with torch.inference_mode():
            expected = model(ids[None], reference, last_only=True, step=batch)[0]
        got = step(ids, batch)
        assert_close_to_scale(got, expected, "int16")


@pytest.mark.parametrize("field, value", [("window", WINDOW + 1), ("window", 0), ("q_norm", 0), ("post_attn_norm", 0)])
def test_a_wrong_descriptor_field_changes_the_logits(field, value):
    model = gemma_model()
    lengths = [45, 130]
    pool, tables = fill(model, lengths)
    reference = copy.deepcopy(pool)
    step = PagedDecodeStep(model, pool, max_rows=2)
    layer = step._layers[0]  # a sliding layer
    setattr(layer, field, value)
    ids = torch.tensor([5, 7])
    batch = StepBatch.build(lengths, [1, 1], block_size=BLOCK, group_tables=tables)
    with torch.inference_mode():
        expected = model(ids[None], reference, last_only=True, step=batch)[0]
    if field == "window" and value == 0:  # attending over released blocks must be refused, not read
        for tables_of_group in tables:
            for table in tables_of_group:
                assert all(b != RELEASED for b in table[len(table) - 3:])
        with pytest.raises(ValueError, match="outside"):
            step(ids, batch)
        return
    got = step(ids, batch)
    assert (got - expected).abs().max() > 1e-2
