"""KIVI pools (kivi4, kivi2) in the C paged step (csrc/kivi_attend.h): its stores are KiviPlanes.store's
byte for byte, and its steps the module path's (the reference) up to summation order.

KIVI holds quantised tokens in blocks and each sequence's newest tokens in a full-precision ring at
its seat, quantising a whole group of G tokens once it lies R back; the cases below cross group
boundaries, wrap the ring, store several groups in one call (a prompt), and start from nothing."""

import copy
import ctypes

import pytest
import torch

from kvlab.cache.kivi_pool import KiviPlanes
from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.nn.c_abi import KVPlane
from kvlab.nn.config import ModelConfig
from kvlab.nn.paged_decode import PagedDecodeStep, why_not_paged
from kvlab.plan.kv_formats import resolve_kv_format
from test_c_model import GQA, assert_close_to_scale, ggml_model

from needs import require_kernels


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


def planes(name: str, heads: int, dim: int, group: int, residual: int, block_size: int, blocks: int = 24,
           seats: int = 3) -> KiviPlanes:
    fmt = resolve_kv_format(name, "fp32", group, residual)
    return KiviPlanes(fmt, [0], blocks, block_size, heads, dim, dim, seats, torch.float32, torch.device("cpu"),
                      lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))


def c_planes(p: KiviPlanes) -> tuple[KVPlane, KVPlane]:
    return (KVPlane(p.k_codes[0].data_ptr(), p.k_scale[0].data_ptr(), p.k_zero[0].data_ptr(), None,
                    p.k_ring[0].data_ptr()),
            KVPlane(p.v_codes[0].data_ptr(), p.v_scale[0].data_ptr(), p.v_zero[0].data_ptr(), None,
                    p.v_ring[0].data_ptr()))


def assert_same_bytes(ours: KiviPlanes, theirs: KiviPlanes) -> None:
    """Codes, scales and rings bit for bit; zeros as values (a group whose minimum is 0 may keep either
    sign of it: torch's vectorised min picks either, and both dequantise alike)."""
    for name in ("k_codes", "k_scale", "v_codes", "v_scale", "k_ring", "v_ring"):
        a, b = getattr(ours, name)[0], getattr(theirs, name)[0]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for name in ("k_zero", "v_zero"):
        assert torch.equal(getattr(ours, name)[0], getattr(theirs, name)[0]), name


# (format, heads, head dim, G, R, block size, tokens fed per call): group boundaries, a ring of R + G rows
# wrapping many times, R = 0 (a group quantised as soon as it is whole), a prompt of several groups at once,
# groups wider than the head (one value group), and value groups not of whole words
CASES = [("kivi4", 2, 64, 32, 128, 64, [200, 1, 1, 31, 1, 5, 40, 1, 1, 1, 64]),
         ("kivi2", 2, 64, 32, 32, 32, [1] * 70 + [33, 2, 100]),
         ("kivi4", 1, 16, 8, 0, 16, [3, 5, 8, 1, 1, 9, 30, 1]),
         ("kivi2", 3, 16, 32, 64, 32, [97, 1, 1, 1, 64, 1]),
         ("kivi4", 2, 48, 8, 16, 8, [1] * 40 + [17, 3]),
         ("kivi2", 1, 32, 16, 16, 32, [50, 50, 1, 1, 1])]


@pytest.mark.parametrize("name,heads,dim,group,residual,block_size,feeds", CASES,
                         ids=lambda case: str(case) if not isinstance(case, list) else f"{len(case)}calls")
def test_c_stores_are_kivi_pool_stores_byte_for_byte(kernels_lib, name, heads, dim, group, residual, block_size,
                                                     feeds):
    generator = torch.Generator().manual_seed(3)
    theirs = planes(name, heads, dim, group, residual, block_size, blocks=-(-sum(feeds) // block_size) + 4)
    ours = copy.deepcopy(theirs)
    k_plane, v_plane = c_planes(ours)
    table = torch.randperm(theirs.k_codes[0].shape[0], generator=generator).to(torch.int32)
    seat, start = 1, 0
    for n in feeds:
        k = torch.randn(n, heads, dim, generator=generator) * 3
        v = torch.randn(n, heads, dim, generator=generator)
        k[:, :, 1] = 0.0  # a constant channel: scale 0
        theirs.store(0, k, v, [start], [n], [table.tolist()], [seat])
        kernels_lib.kvlab_kivi_store(ctypes.byref(k_plane), ctypes.byref(v_plane), theirs.bits, group, residual,
                                     block_size, heads, dim, seat, start, n, k.data_ptr(), v.data_ptr(),
                                     table.data_ptr())
        start += n
        assert_same_bytes(ours, theirs)
    assert theirs.quantised(start) > 0


LONG = ModelConfig(**{**GQA.to_dict(), "max_seq_len": 512, "name": "gqa"})


def kivi_pool(model, name: str, group: int, residual: int, block_size: int, blocks: int, seats: int) -> KVPool:
    return KVPool.for_model(model.config, blocks, block_size, name, group_size=group, residual=residual,
                            seats=seats)


# (model, G): 16-channel heads read lane by lane; 64-channel heads in groups of 32 as planes of whole words;
# six query heads to a KV head in packs of four and two
SHAPES = [(LONG, 8), (LONG.with_kv_heads(1), 8),
          (ModelConfig(**{**LONG.to_dict(), "dim": 128, "n_heads": 4, "n_kv_heads": 2, "name": "d32"}), 16),
          (ModelConfig(**{**LONG.to_dict(), "dim": 128, "n_heads": 2, "n_kv_heads": 1, "name": "d64"}), 32),
          (ModelConfig(**{**LONG.to_dict(), "dim": 96, "n_heads": 6, "n_kv_heads": 1, "name": "packs4+2"}), 8)]


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
@pytest.mark.parametrize("config,group", SHAPES,
                         ids=lambda c: f"{c.name}-kv{c.kv_heads}" if hasattr(c, "name") else f"g{c}")
def test_c_steps_equal_module_steps(name, config, group):
    """A prompt chunk per sequence (several groups quantised in one call), then decode steps that
    cross group boundaries and wrap the rings, each from the module path's copy of the C step's pool:
    logits up to summation order. One layer: with more, a code one apart in a layer's new keys (inputs
    equal up to summation order on a rounding boundary) moves the next layer by a step of the grid
    (test_paged_decode.one_layer_if_coarse); the engine tests hold deeper models to the same tokens."""
    model = ggml_model(ModelConfig(**{**config.to_dict(), "n_layers": 1}))
    residual, block_size = 32, 32
    lens, seats = [70, 23, 9], [2, 0, 1]
    pool = kivi_pool(model, name, group, residual, block_size, 40, 3)
    assert why_not_paged(model, pool) is None
    step = PagedDecodeStep(model, pool, 8)
    reference = copy.deepcopy(pool)
    tables = [list(range(0, 5)), list(range(13, 17)), list(range(26, 29))]
    generator = torch.Generator().manual_seed(5)
    feeds = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lens]
    with torch.inference_mode():
        got = step.feeds(feeds, [0, 0, 0], tables, seats=seats)
        expected = model(torch.tensor([sum(feeds, [])]), reference,
                         step=StepBatch.build([0, 0, 0], lens, tables, block_size, seats=seats))[0]
    assert_close_to_scale(got, expected)
    ids = expected[torch.tensor(lens).cumsum(0) - 1].argmax(-1)
    positions = list(lens)
    for _ in range(60):  # the shortest sequence passes R + G and quantises; every ring wraps
        reference = copy.deepcopy(pool)
        batch = StepBatch.build(positions, [1, 1, 1], tables, block_size, seats=seats)
        with torch.inference_mode():
            expected = model(ids[None], reference, last_only=True, step=batch)[0]
        got = step(ids, batch)
        assert_close_to_scale(got, expected)
        ids, positions = expected.argmax(-1), [p + 1 for p in positions]
    assert pool.kivi.quantised(positions[2]) > 0


def test_rows_that_disagree_with_their_seats_are_refused_not_written(kernels_lib):
    """Two sequences in one seat, or a row whose quantised count is not its sequence's, fail the step with
    nothing written."""
    model = ggml_model(LONG)
    pool = kivi_pool(model, "kivi4", 8, 16, 16, 8, 2)
    step = PagedDecodeStep(model, pool, 4)
    before = [t.clone() for t in pool.tensors()]
    with pytest.raises(ValueError, match="outside the model or pool"):
        step.feeds([[1, 2], [3]], [0, 0], [[0, 1], [2, 3]], seats=[1, 1])  # adjacent: read as one sequence
    with pytest.raises(ValueError, match="outside the model or pool"):
        step.feeds([[1], [2], [3]], [0, 0, 0], [[0], [1], [2]], seats=[0, 1, 0])
    with pytest.raises(ValueError, match="outside the model or pool"):
        step.feeds([[1]], [0], [[0]], seats=[2])  # the pool has seats 0 and 1
    assert all(torch.equal(a, b) for a, b in zip(before, pool.tensors()))


@pytest.mark.parametrize("group,reason", [(12, "groups of a multiple of 8"), (512, "up to 256")])
def test_kivi_groups_the_c_step_cannot_cut_say_why(group, reason):
    model = ggml_model(LONG)
    pool = kivi_pool(model, "kivi4", group, 0, group, 2, 1)
    assert reason in why_not_paged(model, pool)
