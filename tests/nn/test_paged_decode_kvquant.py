"""KVQuant pools (kvquant3/kvquant4) in the C paged step (csrc/kvquant_attend.h): what it writes is
KVQuantPlanes.store's bytes exactly (codes, counts, the seat's key outliers and sinks, value scales and
outliers), however the rows are chunked; its steps' logits are the module path's (pre-RoPE keys rotated
after reading, the sink in fp16, outliers in place) up to summation order, at positions on both sides of
attention's 128-token chunks, with several rows of one sequence in a step (a prompt's rows)."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.nn.config import ModelConfig
from kvlab.nn.kernels import kernels
from kvlab.nn.kvquant_step import kvquant_struct, set_seats
from kvlab.nn.paged_decode import PagedDecodeStep, why_not_paged
from kvlab.plan.kv_formats import resolve_kv_format
from kvquant_helpers import random_calibration
from test_c_model import GQA, assert_close_to_scale, ggml_model

from needs import require_kernels


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


BLOCK, MAX_TOKENS = 5, 400
ONE_LAYER = ModelConfig(**{**GQA.to_dict(), "n_layers": 1, "max_seq_len": 512, "name": "gqa1"})
# 64-channel heads, three query heads a KV head (SmolLM2's shape): kvquant4 takes the nibble path (kvquant_nibbles.h)
HEAD64 = ModelConfig(**{**ONE_LAYER.to_dict(), "dim": 192, "n_heads": 3, "n_kv_heads": 1, "name": "head64"})


def kvquant_pool(config, dtype: str, num_blocks: int, seats: int, cal=None) -> KVPool:
    cal = cal or random_calibration(config)
    return KVPool(config.n_layers, config.kv_heads, config.head_size, config.head_size, num_blocks, BLOCK,
                  resolve_kv_format(dtype), seats=seats, calibration=cal, max_tokens=MAX_TOKENS)


def c_store(pool: KVPool, layer: int, k: torch.Tensor, v: torch.Tensor, positions: list[int],
            tables: list[list[int]], seats: list[int]) -> None:
    """Rows k, v [rows, heads, dim] stored by the C step's writer (kvlab_kvquant_store)."""
    struct, keep = kvquant_struct(pool)
    seat_rows = set_seats(struct, torch.tensor(seats), len(seats))
    rows = torch.cat([k, v], dim=1).float().contiguous()
    widest = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (widest - len(t)) for t in tables], dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.int32)
    status = kernels().kvlab_kvquant_store(ctypes.byref(struct), layer, pool.kv_heads, pool.k_head_dim, len(seats),
                                           rows.data_ptr(), pos.data_ptr(), table.data_ptr(), widest, BLOCK)
    assert status == 0 and seat_rows is not None and keep


def planes_bytes(pool: KVPool) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for t in pool.kvquant.tensors()]


@pytest.mark.parametrize("dtype", ["kvquant3", "kvquant4"])
@pytest.mark.parametrize("chunks", [[1] * 9, [13, 1, 1, 6], [30], [2, 140, 1]])
@pytest.mark.parametrize("dim", [16, 64])
def test_c_writes_are_the_pools_bytes(dtype: str, chunks: list[int], dim: int) -> None:
    """Two sequences on scattered blocks, seats 2 and 0, their rows in `chunks` (each chunk one C call, both
    sequences' rows in it): every byte of the C-written pool equals KVQuantPlanes.store's, outliers clustered
    in a few tokens (which borrow slots earlier rows left) included."""
    config = ModelConfig(vocab_size=32, dim=2 * dim, n_layers=2, n_heads=2, n_kv_heads=2, max_seq_len=512)
    cal = random_calibration(config)
    total = sum(chunks)
    ours, theirs = (kvquant_pool(config, dtype, 2 * (total // BLOCK + 2) + 3, 3, cal) for _ in range(2))
    order = torch.randperm(ours.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [order[:total // BLOCK + 1], order[total // BLOCK + 1:2 * (total // BLOCK + 1)]]
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(2, total, 2, dim, generator=generator) * 2 + 0.5
    k[:, 3, :, 2:9] *= 6
    v = torch.randn(2, total, 2, dim, generator=generator)
    start = 0
    for n in chunks:
        step = StepBatch.build([start, start], [n, n], tables, BLOCK, seats=[2, 0])
        for layer in range(2):
            kn, vn = k[:, start:start + n].reshape(2 * n, 2, dim), v[:, start:start + n].reshape(2 * n, 2, dim)
            theirs.store(layer, kn, vn, step)
            c_store(ours, layer, kn, vn, [start + i for i in range(n)] * 2, [tables[0]] * n + [tables[1]] * n,
                    [2] * n + [0] * n)
        start += n
    for a, b in zip(planes_bytes(ours), planes_bytes(theirs)):
        assert torch.equal(a, b)


POSITIONS = {1: [317], 3: [10, 317, 4], 9: [0, 1, 4, 9, 127, 128, 129, 255, 256]}


def filled_pool(model, positions: list[int], dtype: str):
    """A KVQuant pool holding each row's first positions[r] tokens (written by the module path), row r in seat
    len - 1 - r, the tables and the ids."""
    need = sum(pos // BLOCK + 3 for pos in positions)
    pool = kvquant_pool(model.config, dtype, need + 7, len(positions) + 1)
    order = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables, at = [], 0
    for pos in positions:
        tables.append(order[at:at + pos // BLOCK + 3])
        at += pos // BLOCK + 3
    seats = [len(positions) - 1 - r for r in range(len(positions))]
    generator = torch.Generator().manual_seed(2)
    prompts = [(row, pos) for row, pos in enumerate(positions) if pos > 0]
    lens = [pos for _, pos in prompts]
    tokens = torch.randint(0, model.config.vocab_size, (1, sum(lens)), generator=generator)
    batch = StepBatch.build([0] * len(lens), lens, [tables[row] for row, _ in prompts], BLOCK,
                            seats=[seats[row] for row, _ in prompts])
    with torch.inference_mode():
        model(tokens, pool, last_only=True, step=batch)
    ids = torch.randint(0, model.config.vocab_size, (len(positions),), generator=generator)
    return pool, tables, seats, ids


@pytest.mark.parametrize("dtype", ["kvquant3", "kvquant4"])
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("config", [ONE_LAYER, ONE_LAYER.with_kv_heads(1),
                                    ModelConfig(**{**ONE_LAYER.to_dict(), "rope_style": "interleaved"}), HEAD64],
                         ids=["gqa", "mqa", "interleaved", "head64"])
def test_c_steps_equal_module_steps(dtype: str, rows: int, config) -> None:
    """Two decode steps: the logits equal the module path's reading the same pool (each step starts the module
    path from the C step's pool, so a code one apart at a rounding boundary does not compare grids)."""
    model = ggml_model(config)
    positions = POSITIONS[rows]
    pool, tables, seats, ids = filled_pool(model, positions, dtype)
    assert why_not_paged(model, pool) is None
    step = PagedDecodeStep(model, pool, max_rows=rows)
    for index in range(2):
        reference = copy.deepcopy(pool)
        batch = StepBatch.build([p + index for p in positions], [1] * rows, tables, BLOCK, seats=seats)
        with torch.inference_mode():
            expected = model(ids[None], reference, last_only=True, step=batch)[0]
        got = step(ids, batch)
        assert_close_to_scale(got, expected)
        ids = expected.argmax(-1)


@pytest.mark.parametrize("dtype", ["kvquant3", "kvquant4"])
def test_a_prompts_rows_in_one_c_call_equal_the_module_path(dtype: str) -> None:
    """A prompt chunk fed as rows (PagedDecodeStep.feeds, as the engine feeds prompts): each row attends over
    the rows before it written in the same call; the last rows' logits equal the module path's."""
    model = ggml_model(ONE_LAYER)
    pool, tables, seats, _ = filled_pool(model, [130, 3], dtype)
    reference = copy.deepcopy(pool)
    feeds = [list(range(1, 12)), list(range(20, 25))]
    step = PagedDecodeStep(model, pool, max_rows=32)
    got = step.feeds(feeds, [130, 3], tables, seats=seats)
    batch = StepBatch.build([130, 3], [11, 5], tables, BLOCK, seats=seats)
    with torch.inference_mode():
        expected = model(torch.tensor([[t for f in feeds for t in f]]), reference, step=batch)[0]
    assert_close_to_scale(got, expected)


def test_a_step_without_seats_or_with_a_bad_seat_is_refused() -> None:
    model = ggml_model(ONE_LAYER)
    pool, tables, seats, ids = filled_pool(model, [10, 4], "kvquant4")
    step = PagedDecodeStep(model, pool, max_rows=2)
    with pytest.raises(ValueError, match="needs each row's seat"):
        step.rows(ids, torch.tensor([10, 4]), tables)
    with pytest.raises(ValueError, match="outside the model or pool"):
        step(ids, StepBatch.build([10, 4], [1, 1], tables, BLOCK, seats=[0, pool.seats]))
