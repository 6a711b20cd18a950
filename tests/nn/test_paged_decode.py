"""The C paged decode step (rows at their own positions in the engine's KVPool) against the
module-by-module path, which stays the reference: the logits, and the K/V it wrote."""

import copy
import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch

from kvlab.cache.pool import DEFAULT_BLOCK_SIZE, KVPool
from kvlab.cache.quantize import FP8_DTYPES, fp8_quantize, pack_codes, quantize_groups, unpack_codes
from kvlab.cache.step import StepBatch
from kvlab.nn.c_abi import CONSTANTS, MIRRORS, KVPlane, LlamaModel, abi_mismatches, abi_table
from kvlab.nn.config import ModelConfig
from kvlab.nn.kernels import using_kernel_isa
from kvlab.nn.model import Decoder
from kvlab.nn.paged_decode import PagedDecodeStep, paged_step_for, why_not_paged
from kvlab.plan.kv_formats import C_STEP_KV_CACHE_DTYPES, POOL_KV_CACHE_DTYPES
from test_c_model import GQA, TOLERANCE, assert_close_to_scale, ggml_model
from test_ggml import isas_here

from needs import require_kernels


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


LONG = ModelConfig(**{**GQA.to_dict(), "max_seq_len": 512, "name": "gqa"})
CONFIGS = [LONG, LONG.with_kv_heads(1), LONG.with_kv_heads(4),
           ModelConfig(**{**LONG.to_dict(), "rope_style": "interleaved", "n_layers": 3, "name": "interleaved"})]
BLOCK = 5
# Positions of the token each row decodes: block starts (0, 5, 10, 130), last slots of a block
# (4, 14, 129), both sides of attention's 128-token chunks (127, 128, 255, 256) and one at 317
# (three chunks, the last partly filled).
POSITIONS = {1: [317], 3: [10, 317, 4],
             17: [0, 1, 4, 5, 9, 10, 14, 22, 63, 127, 128, 129, 130, 201, 255, 256, 317]}


def layout(positions: list[int], num_blocks: int, seed: int = 0, block_size: int = BLOCK) -> list[list[int]]:
    """Block tables for rows decoding at `positions`: shuffled, non-contiguous blocks, and some
    tables a block longer than needed (the engine allocates ahead), so padding is exercised."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for row, pos in enumerate(positions):
        need = (pos + 1) // block_size + 1 + row % 2  # room for two steps
        tables.append(order[at:at + need])
        at += need
    assert at <= num_blocks
    return tables


def filled_pool(model: Decoder, positions: list[int], kv_cache_dtype: str, group_size=None, block_size: int = BLOCK,
                **pool_args):
    """A pool holding each row's first `positions[r]` tokens (written by the module path), the tables, and ids."""
    need = sum(pos // block_size + 3 for pos in positions)
    if pool_args:
        pool = KVPool(model.config.n_layers, model.config.kv_heads, model.config.head_size, model.config.head_size,
                      need + 7, block_size, **pool_args)
    else:
        pool = KVPool.for_model(model.config, need + 7, block_size, kv_cache_dtype, group_size=group_size)
    tables = layout(positions, pool.num_blocks, block_size=block_size)
    generator = torch.Generator().manual_seed(2)
    prompts = [(row, pos) for row, pos in enumerate(positions) if pos > 0]
    if prompts:
        lens = [pos for _, pos in prompts]
        tokens = torch.randint(0, model.config.vocab_size, (1, sum(lens)), generator=generator)
        batch = StepBatch.build([0] * len(lens), lens, [tables[row] for row, _ in prompts], block_size)
        with torch.inference_mode():
            model(tokens, pool, last_only=True, step=batch)
    ids = torch.randint(0, model.config.vocab_size, (len(positions),), generator=generator)
    return pool, tables, ids


def assert_pools_agree(ours: KVPool, reference: KVPool, batches: list[StepBatch], activations: str = "int16") -> None:
    """Every slot the decode steps `batches` did not write is untouched (bit for bit); the written
    ones hold what the module path wrote: as close as the logits for floats, one rounding step
    for narrow floats, the same int8/int4/int2 codes (or one apart where an input sat on a
    rounding boundary; packed codes are compared unpacked)."""
    bits = getattr(ours.codecs[0], "bits", 8)
    written = [(slot // BLOCK, slot % BLOCK) for batch in batches for slot in batch.slot_mapping.tolist()]
    blocks = torch.tensor([b for b, _ in written])
    offsets = torch.tensor([o for _, o in written])
    for layer in range(ours.num_layers):
        for side in ("k", "v"):
            mine, theirs = getattr(ours, side)[layer], getattr(reference, side)[layer]
            for name in mine:
                a, b = mine[name].clone(), theirs[name].clone()
                new_a, new_b = a[blocks, :, offsets], b[blocks, :, offsets]  # [rows, heads, width]
                a[blocks, :, offsets] = 0
                b[blocks, :, offsets] = 0
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
                    f"layer {layer} {side}.{name}: a slot the step did not own changed"
                assert torch.count_nonzero(new_b.float()) > 0
                if name == "codes":
                    gap = (unpack_codes(new_a, bits, ours.k_head_dim).int() -
                           unpack_codes(new_b, bits, ours.k_head_dim).int()).abs()
                    # one apart at most, and rarely: 5% of the codes, or 2 where a small model writes few
                    assert gap.max() <= 1 and (gap != 0).sum() <= max(2, 0.05 * gap.numel()), (layer, side, gap)
                elif name in ("scale", "zero"):  # fp16 range ends of inputs equal to float summation order
                    torch.testing.assert_close(new_a.float(), new_b.float(), rtol=2e-3, atol=1e-4)
                else:
                    wide = new_b.float()
                    tol = TOLERANCE[activations] * wide.abs().max().item()
                    if new_b.dtype.itemsize == 1:  # fp8: within one step of its grid (3 or 2 mantissa bits)
                        rtol = 2.0 ** -(3 if new_b.dtype == torch.float8_e4m3fn else 2)
                    else:
                        rtol = torch.finfo(new_b.dtype).eps
                    torch.testing.assert_close(new_a.float(), wide, rtol=rtol, atol=tol)


def check_steps(model: Decoder, positions: list[int], kv_cache_dtype: str = "auto", steps: int = 2,  # at most 2
                group_size=None, **pool_args) -> None:
    """Run `steps` decode steps both ways from one filled pool; compare logits and pools each step.

    int4 and int2 grids are coarse: where a code written by both paths sits on a rounding
    boundary (one code apart, allowed), the next step's logits differ by that code's step of
    the grid (1/15 or 1/3 of a group's range), not by summation order. So on those pools each
    step after the first starts the module path from the C step's pool: the logits then
    compare the arithmetic, and the codes are compared each step as they were written."""
    activations = {getattr(m, "activations", "int16") for m in model.modules()}
    activations = "int8" if "int8" in activations else "int16"  # the looser, where any layer has int8
    pool, tables, ids = filled_pool(model, positions, kv_cache_dtype, group_size, **pool_args)
    reference = copy.deepcopy(pool)
    step = PagedDecodeStep(model, pool, max_rows=len(positions))
    batches = []
    for index in range(steps):
        batch = StepBatch.build([p + index for p in positions], [1] * len(positions), tables, BLOCK)
        batches.append(batch)
        if index and getattr(pool.codecs[0], "bits", 8) < 8:
            reference = copy.deepcopy(pool)
            batches = [batch]
        with torch.inference_mode():
            expected = model(ids[None], reference, last_only=True, step=batch)[0]
        got = step(ids, batch)
        assert got.shape == expected.shape == (len(positions), model.config.vocab_size)
        assert_close_to_scale(got, expected, activations)
        assert_pools_agree(pool, reference, batches, activations)
        ids = expected.argmax(-1)


def one_layer_if_coarse(config: ModelConfig, kv_cache_dtype: str) -> ModelConfig:
    """int4/int2 models of one layer: with more, a last-bit difference in one layer's attention
    can move a later layer's new K/V code across a rounding boundary within the same step, and
    the logits would measure that step of a coarse grid (1/15 or 1/3 of a group's range)
    instead of the arithmetic. The engine tests (tests/engine/test_engine_c_step.py) hold
    deeper models to the module path's greedy tokens."""
    return ModelConfig(**{**config.to_dict(), "n_layers": 1}) if kv_cache_dtype in ("int4", "int2") else config


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.name}-kv{c.kv_heads}")
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_paged_steps_equal_module_steps(config, rows, activations):
    check_steps(ggml_model(config, activations=activations), POSITIONS[rows])


@pytest.mark.parametrize("kv_cache_dtype,group_size", [("fp16", None), ("bf16", None), ("fp8_e4m3", None),
                                                       ("fp8_e5m2", None), ("int8", None), ("int8", 8), ("int4", None),
                                                       ("int4", 8), ("int2", None), ("int2", 8)],
                         ids=["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int8-g8", "int4", "int4-g8", "int2",
                              "int2-g8"])
def test_narrow_pools_equal_module_steps(kv_cache_dtype, group_size):
    """fp8 and the group formats are dequantised inside C's attention loop; -g8 has two groups per head."""
    check_steps(ggml_model(one_layer_if_coarse(LONG, kv_cache_dtype)), POSITIONS[3], kv_cache_dtype,
                group_size=group_size)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_scales_per_tensor_and_per_head(name):
    from kvlab.plan.kv_formats import resolve_kv_format

    fmt = resolve_kv_format(name, "fp32", None)
    check_steps(ggml_model(LONG), POSITIONS[3], fmt=fmt, k_scale=0.05, v_scale=[0.5, 0.02])


# Shapes that take the attention kernel's other paths: 64-channel heads (SmolLM2's; value
# passes of 32 channels, three query heads a pack), and groups of 8 and 6 query heads per KV
# head, which go in packs of four and the rest.
WIDE = ModelConfig(**{**LONG.to_dict(), "dim": 192, "n_heads": 3, "n_kv_heads": 1, "name": "wide-d64"})
PACKS = [WIDE, ModelConfig(**{**LONG.to_dict(), "n_heads": 8, "n_kv_heads": 1, "name": "group8-d8"}),
         ModelConfig(**{**LONG.to_dict(), "dim": 96, "n_heads": 6, "n_kv_heads": 1, "name": "group6-d16"})]


@pytest.mark.parametrize("config", PACKS, ids=lambda c: c.name)
@pytest.mark.parametrize("kv_cache_dtype,group_size", [("auto", None), ("fp8_e4m3", None), ("int8", None),
                                                       ("int8", 16), ("int4", None), ("int4", 16), ("int2", 16)],
                         ids=["fp32", "fp8_e4m3", "int8", "int8-g16", "int4", "int4-g16", "int2-g16"])
def test_head_shapes_and_query_packs(config, kv_cache_dtype, group_size):
    check_steps(ggml_model(one_layer_if_coarse(config, kv_cache_dtype)), POSITIONS[3], kv_cache_dtype,
                group_size=group_size, steps=1)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_seventeen_rows_in_a_group_pool(activations, kv_cache_dtype):
    check_steps(ggml_model(one_layer_if_coarse(LONG.with_kv_heads(1), kv_cache_dtype), activations=activations),
                POSITIONS[17], kv_cache_dtype, steps=1)


# int4/int2 rows whose groups are whole words (16 channels for int4, 32 for int2) are read eight
# bytes at a time as planes of codes, against query heads permuted to the planes' order
# (csrc/kv_codecs.h, packed_word): heads of 64 and 128 channels, one group or several (3 of 48,
# 48 and 32 channels; 2 of 80 and 48: the last one short), query packs of 1, 3, 4 and 2.
PLANE_HEADS = {shape["name"]: ModelConfig(**{**LONG.to_dict(), **shape, "n_layers": 1}) for shape in [
    {"dim": 128, "n_heads": 2, "n_kv_heads": 2, "name": "d64-pack1"},
    {"dim": 192, "n_heads": 3, "n_kv_heads": 1, "name": "d64-pack3"},
    {"dim": 768, "n_heads": 6, "n_kv_heads": 1, "name": "d128-packs4+2"}]}
PLANES = [("d64-pack3", "int4", None), ("d64-pack3", "int4", 16), ("d64-pack3", "int2", None),
          ("d64-pack1", "int4", None), ("d64-pack1", "int2", 32), ("d128-packs4+2", "int4", None),
          ("d128-packs4+2", "int4", 48), ("d128-packs4+2", "int4", 80), ("d128-packs4+2", "int2", 96)]


@pytest.mark.parametrize("shape,kv_cache_dtype,group_size", PLANES,
                         ids=[f"{shape}-{dtype}" + (f"-g{group}" if group else "") for shape, dtype, group in PLANES])
def test_packed_rows_read_as_planes_equal_module_steps(shape, kv_cache_dtype, group_size):
    """One step of 17 rows (chunks of many lengths) against the module path: a plane read into the
    wrong channel, or a group's scale applied to the wrong words, moves the logits by a code's
    share of a group's range, far past summation order."""
    check_steps(ggml_model(PLANE_HEADS[shape]), POSITIONS[17], kv_cache_dtype, group_size=group_size, steps=1)


# Heads of 64 and 128 channels, which AVX-512 attends in units of their own (int8 with one
# group per row on integer dot products, csrc/attend_int8.h; fp8 on table-converted fp32
# lanes, csrc/attend_fp8.h) and AVX2 in its fp32 loop: query packs of 1, 2, 3 (SmolLM2's) and
# 4, a head of two 64-byte segments, 17 rows whose chunks end at many lengths. One layer, so both
# steps write the same codes; with more, a last-bit difference in one layer's attention can
# move a later layer's K/V code across a rounding boundary, and the logits compared would
# measure that step of the int8 grid instead of the arithmetic. Blocks of 5 tokens (chunks
# cut blocks) and of the engine's default size (whole blocks in a chunk).
INTEGER_SHAPES = [(ModelConfig(**{**LONG.to_dict(), **shape, "n_layers": 1}), group) for shape, group in [
    ({"dim": 128, "n_heads": 2, "n_kv_heads": 2, "name": "d64-pack1"}, None),
    ({"dim": 256, "n_heads": 2, "n_kv_heads": 1, "name": "d128-pack2"}, 128),
    ({"dim": 192, "n_heads": 3, "n_kv_heads": 1, "name": "d64-pack3"}, None),
    ({"dim": 512, "n_heads": 8, "n_kv_heads": 1, "name": "d64-group8"}, None)]]


def avx512_against_avx2(config: ModelConfig, kv_cache_dtype: str, group_size, block_size: int) -> None:
    """The same 17-row step with the AVX2 attention loop and with the AVX-512 unit: the same
    pool written, logits equal up to summation order, and not bit-equal (the unit ran)."""
    model = ggml_model(config)
    pool, tables, ids = filled_pool(model, POSITIONS[17], kv_cache_dtype, group_size, block_size)
    other = copy.deepcopy(pool)
    batch = StepBatch.build(POSITIONS[17], [1] * 17, tables, block_size)
    with using_kernel_isa("avx2"):
        loop = PagedDecodeStep(model, pool, max_rows=17)(ids, batch)
    with using_kernel_isa("avx512_vnni"):
        unit = PagedDecodeStep(model, other, max_rows=17)(ids, batch)
    assert all(torch.equal(a, b) for a, b in zip(pool.tensors(), other.tensors()))
    assert not torch.equal(unit, loop)  # the AVX-512 unit ran
    assert_close_to_scale(unit, loop)


@pytest.mark.parametrize("block_size", [BLOCK, DEFAULT_BLOCK_SIZE])
@pytest.mark.parametrize("config,group_size", INTEGER_SHAPES, ids=[c.name for c, _ in INTEGER_SHAPES])
def test_int8_attention_on_integer_products_matches_fp32_products(config, group_size, block_size):
    if "avx512_vnni" not in isas_here():
        pytest.skip("this CPU (or its OS) lacks AVX-512 VNNI")
    avx512_against_avx2(config, "int8", group_size, block_size)


@pytest.mark.parametrize("block_size", [BLOCK, DEFAULT_BLOCK_SIZE])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("config", [c for c, _ in INTEGER_SHAPES], ids=[c.name for c, _ in INTEGER_SHAPES])
def test_fp8_attention_on_table_converted_lanes_matches_the_avx2_loop(kernels_lib, config, kv_cache_dtype,
                                                                     block_size):
    """attend_fp8_vbmi.c converts codes through byte tables: a wrong entry, sign or lane order
    moves the logits by their whole scale, not by summation order."""
    if "avx512_vnni" not in isas_here() or not kernels_lib.fp8_vbmi_usable():
        pytest.skip("this CPU (or its OS) lacks AVX-512 VNNI or VBMI")
    avx512_against_avx2(config, kv_cache_dtype, None, block_size)


def test_the_module_path_reads_what_the_c_step_wrote():
    """The engine may switch paths at any step (a prompt chunk runs module by module)."""
    model = ggml_model(LONG)
    positions = POSITIONS[3]
    pool, tables, ids = filled_pool(model, positions, "int8")
    reference = copy.deepcopy(pool)
    first = StepBatch.build(positions, [1] * 3, tables, BLOCK)
    PagedDecodeStep(model, pool, 3)(ids, first)
    with torch.inference_mode():
        model(ids[None], reference, last_only=True, step=first)
        second = StepBatch.build([p + 1 for p in positions], [1] * 3, tables, BLOCK)
        expected = model(ids[None], reference, last_only=True, step=second)[0]
        got = model(ids[None], pool, last_only=True, step=second)[0]
    assert_close_to_scale(got, expected)


def test_a_bad_block_or_batch_is_refused_not_overrun():
    model = ggml_model(LONG)
    pool, tables, ids = filled_pool(model, [3, 7], "auto")
    step = PagedDecodeStep(model, pool, max_rows=2)
    before = [t.clone() for t in pool.tensors()]
    bad = StepBatch.build([3, 7], [1, 1], [tables[0], [pool.num_blocks] + tables[1][1:]], BLOCK)
    with pytest.raises(ValueError, match="outside the model or pool"):
        step(ids, bad)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.tensors()))
    with pytest.raises(ValueError, match="one token per sequence"):
        step(torch.tensor([1, 2, 3]), StepBatch.build([3, 7], [2, 1], tables, BLOCK))
    with pytest.raises(ValueError, match="at most 1"):
        PagedDecodeStep(model, pool, max_rows=1)(ids, StepBatch.build([3, 7], [1, 1], tables, BLOCK))


@pytest.mark.parametrize("change,reason", [
    (lambda model: (model, KVPool.for_model(model.config, 8, BLOCK, "int8", group_size=12)), "multiple of 8"),
    (lambda model: (model, KVPool.for_model(model.config, 8, BLOCK, "int4", group_size=12)), "not int4"),
    (lambda model: (model, KVPool.for_model(model.config, 8, BLOCK, "int2", group_size=4)), "not int2"),
    (lambda model: (model, KVPool.for_model(model.config, 8, 24, "kivi4", seats=2, group_size=12, residual=12)),
     "groups of a multiple of 8"),
    (lambda model: (model, KVPool.for_model(model.config, 8, BLOCK, "fp16", torch.float16)), "fp32 values"),
    (lambda model: (model, KVPool.for_model(LONG.with_kv_heads(1), 8, BLOCK)), "KV heads and head dim"),
    (lambda model: (model, model.new_cache(1, 8)), "KVPool"),
    (lambda model: (Decoder(LONG), KVPool.for_model(LONG, 8, BLOCK)), "held as GGUF blocks"),
])
def test_what_cannot_run_in_c_says_why(change, reason):
    model, pool = change(ggml_model(LONG))
    assert reason in why_not_paged(model, pool)
    assert paged_step_for(model, pool, 4) is None
    with pytest.raises(ValueError, match="cannot run the paged decode step"):
        PagedDecodeStep(model, pool, 4)


@pytest.mark.parametrize("field,value", [("cache_dtype", 10), ("cache_dtype", -1), ("group_size", 12),
                                         ("group_size", 0)])
def test_a_wrong_cache_descriptor_is_refused_by_the_c_side(field, value):
    """The C step checks the format code and group size it is handed (-4) before touching the pool:
    an int4 descriptor with an unknown code, or groups the loops cannot cut, writes nothing."""
    model = ggml_model(LONG)
    pool, tables, ids = filled_pool(model, [3, 7], "int4", group_size=8)
    step = PagedDecodeStep(model, pool, max_rows=2)
    before = [t.clone() for t in pool.tensors()]
    setattr(step._struct, field, value)
    with pytest.raises(ValueError, match="cannot run this cache format"):
        step(ids, StepBatch.build([3, 7], [1, 1], tables, BLOCK))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.tensors()))


def test_paged_step_for_builds_the_step_where_it_applies():
    model = ggml_model(LONG)
    assert isinstance(paged_step_for(model, KVPool.for_model(LONG, 8, BLOCK, "fp8"), 4), PagedDecodeStep)


@pytest.mark.parametrize("name", sorted(FP8_DTYPES))
def test_fp8_stores_round_as_torch_does(kernels_lib, name):
    """Every midpoint between neighbouring fp8 values (where rounding to even decides), the
    values beside them, saturation, infinities, NaN, subnormals, zeros and random values: byte
    for byte, through kv_codecs.h's eight-wide encoder (and the scalar one for the tail)."""
    dtype = FP8_DTYPES[name]
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                   torch.nextafter(mids, torch.tensor(-float("inf"))), torch.tensor([0.0, -0.0, 1e9, -1e9, 1e-30, float("inf"), -float("inf"), float("nan")]),
                   torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 30])
    ours = torch.empty(x.numel(), dtype=torch.uint8)
    kernels_lib.kvlab_fp8_encode(int(dtype == torch.float8_e4m3fn), x.data_ptr(), ours.data_ptr(), x.numel())
    assert torch.equal(ours, fp8_quantize(x, dtype).view(torch.uint8))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim,group", [(16, 64), (64, 64), (64, 8), (24, 16), (128, 32)])
def test_group_stores_are_quantize_groups_byte_for_byte(kernels_lib, dim, group, bits):
    """int8/int4/int2 stores: quantize_groups' codes, scales and zeros, packed as pack_codes packs them."""
    generator = torch.Generator().manual_seed(dim + group)
    x = torch.randn(3000, dim, generator=generator) * torch.rand(3000, 1, generator=generator) * 8
    x[::7, :] = x[::7, :1]  # constant rows: scale 0
    x[1::7] = torch.round(x[1::7] * 2) / 2  # values on exact halves of a step, where rounding to even decides
    codes = torch.full((3000, dim * bits // 8), 0xA5, dtype=torch.uint8)  # stale bytes the store must clear
    groups = -(-dim // group)
    scale, zero = torch.empty(3000, groups, dtype=torch.float16), torch.empty(3000, groups, dtype=torch.float16)
    kernels_lib.kvlab_group_quantize(x.data_ptr(), 3000, dim, group, bits, codes.data_ptr(), scale.data_ptr(),
                                     zero.data_ptr())
    want_codes, want_scale, want_zero = quantize_groups(x, bits, group)
    assert torch.equal(codes, pack_codes(want_codes, bits))
    assert torch.equal(scale.view(torch.int16), want_scale.view(torch.int16))
    # zero points as values: a group whose minimum is 0 may store either sign of it (torch's
    # vectorised min picks either one), which dequantises alike
    assert torch.equal(zero, want_zero)


def test_the_library_matches_its_ctypes_mirrors(kernels_lib):
    table = abi_table(kernels_lib)
    assert abi_mismatches(table) == []
    assert table["llama_model"] == ctypes.sizeof(LlamaModel) and table["CACHE_INT8"] == 5


def test_a_drifted_mirror_is_named():
    class Shifted(ctypes.Structure):  # kv_plane without its last field: later llama_layer fields would shift
        _fields_ = KVPlane._fields_[:-1]

    class Swapped(ctypes.Structure):
        _fields_ = [LlamaModel._fields_[1], LlamaModel._fields_[0], *LlamaModel._fields_[2:]]

    table = abi_table(require_kernels())
    problems = abi_mismatches(table, {**MIRRORS, "kv_plane": Shifted, "llama_model": Swapped})
    assert any("sizeof(kv_plane)" in p for p in problems)
    assert any(f"kv_plane.{KVPlane._fields_[-1][0]} is in C but missing" in p for p in problems)
    assert any("offsetof(llama_model, n_layers)" in p for p in problems)
    assert any("constant CHUNK is 128 in C, 64 in Python" in p
               for p in abi_mismatches(table, constants={**CONSTANTS, "CHUNK": 64}))
    assert any("no Python mirror" in p for p in abi_mismatches(table, {k: v for k, v in MIRRORS.items()
                                                                       if k != "qstack"}))


def test_loading_a_library_whose_mirror_drifted_fails_loudly():
    """The loader itself refuses: a fresh interpreter with one ctypes mirror changed."""
    script = textwrap.dedent("""
        import ctypes
        import kvlab.nn.c_abi as abi

        class Short(ctypes.Structure):
            _fields_ = abi.LlamaModel._fields_[:-1]

        abi.MIRRORS["llama_model"] = Short
        from kvlab.nn.kernels import KernelBuildError, kernels
        try:
            kernels()
        except KernelBuildError as error:
            print("refused:", error)
        else:
            print("loaded")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "refused:" in out.stdout, out.stdout + out.stderr
    assert f"llama_model.{LlamaModel._fields_[-1][0]} is in C but missing from Short" in out.stdout


@pytest.mark.parametrize("kv_cache_dtype", POOL_KV_CACHE_DTYPES)
def test_the_format_table_says_which_pools_the_c_step_runs(kv_cache_dtype):
    """kvlab.plan.kv_formats.KV_CACHE_DTYPE_PATHS' "c_step" column is what why_not_paged decides."""
    from kvquant_helpers import random_calibration

    model = ggml_model(LONG)
    calibration = random_calibration(model.config) if kv_cache_dtype.startswith("kvquant") else None
    pool = KVPool.for_model(model.config, 8, 32, kv_cache_dtype, seats=2,  # KIVI: 32-token groups, residual seats
                            calibration=calibration)
    assert (why_not_paged(model, pool) is None) == (kv_cache_dtype in C_STEP_KV_CACHE_DTYPES), \
        why_not_paged(model, pool)
