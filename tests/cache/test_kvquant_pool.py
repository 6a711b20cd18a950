"""KVQuant in the paged pool: the lab's KVQuantCache's keys and values exactly, however steps chunk the
tokens and wherever the blocks lie, in the bytes kvlab.plan.pool_capacity counts."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.base import CacheError
from kvlab.cache.kvquant import make_kvquant_cache
from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.plan.capacity import cache_formats, kv_fixed_bytes
from kvlab.plan.kv_formats import resolve_kv_format
from kvlab.plan.pool_capacity import engine_capacity, kvquant_block_bytes, kvquant_seat_bytes
from kvlab.plan.spec import FULL, LayerAttention, ModelSpec
from test_kvquant import DIM, HEADS, LAYERS, calibration, rope_identity

BLOCK, MAX_TOKENS = 8, 40


def pool(dtype: str, cal, num_blocks: int = 16, seats: int = 3) -> KVPool:
    return KVPool(LAYERS, HEADS, DIM, DIM, num_blocks, BLOCK, resolve_kv_format(dtype), seats=seats,
                  calibration=cal, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("dtype", ["kvquant3", "kvquant4"])
@pytest.mark.parametrize("chunks", [[1] * 12, [13, 1, 1, 6], [30]])
def test_pool_holds_the_lab_caches_keys_and_values(dtype: str, chunks: list[int]) -> None:
    """Two sequences on scattered blocks and seats 2 and 0, fed in `chunks` (the lab's cache gets the
    whole prompt at once): every read equals KVQuantCache's, outliers clustered in a few tokens included."""
    cal = calibration()
    kv = pool(dtype, cal)
    tables = [[9, 2, 14, 5], [0, 11, 7, 3]]
    total = sum(chunks)
    k = torch.randn(2, HEADS, total, DIM) * torch.linspace(0.2, 5, DIM) + 1.0
    k[:, :, 3, 2:9] *= 6  # a token far out of range in seven channels: it borrows slots earlier rows left
    v = torch.randn(2, HEADS, total, DIM)
    want = []
    for s in range(2):
        lab = make_kvquant_cache(dtype, cal, 1, MAX_TOKENS, torch.float32, rope_identity)
        want.append([lab.update(layer, k[s:s + 1], v[s:s + 1]) for layer in range(LAYERS)])
    start = 0
    for n in chunks:
        step = StepBatch.build([start, start], [n, n], tables, BLOCK, seats=[2, 0])
        for layer in range(LAYERS):
            kn = k[:, :, start:start + n].permute(0, 2, 1, 3).reshape(2 * n, HEADS, DIM)
            vn = v[:, :, start:start + n].permute(0, 2, 1, 3).reshape(2 * n, HEADS, DIM)
            kv.store(layer, kn, vn, step)
        start += n
    step = StepBatch.build([total - 1, total - 1], [1, 1], tables, BLOCK, seats=[2, 0])
    for s in range(2):
        for layer in range(LAYERS):
            keys, values, mask = kv.attention_inputs(layer, step, s)
            assert mask is None
            assert torch.equal(keys, want[s][layer][0][0]) and torch.equal(values, want[s][layer][1][0])


def test_pool_bytes_are_the_plans_blocks_seats_and_fixed_bytes() -> None:
    cal = calibration()
    spec = ModelSpec("t", tuple(LayerAttention(FULL, 4, HEADS, DIM, DIM) for _ in range(LAYERS)))
    for dtype in ("kvquant3", "kvquant4"):
        formats = cache_formats(dtype)
        kv = pool(dtype, cal, num_blocks=16, seats=3)
        assert kv.nbytes() == 16 * kvquant_block_bytes(spec, formats, BLOCK) + \
            3 * kvquant_seat_bytes(spec, formats, MAX_TOKENS) + kv_fixed_bytes(spec, formats)
        # the engine's sizing: as many blocks as the budget holds once the seats and fixed bytes are off
        capacity = engine_capacity(spec, kv.nbytes() + 5, MAX_TOKENS, formats, BLOCK, 3)
        assert capacity["num_gpu_blocks"] == 16


def test_by_hand_bytes_for_one_layer() -> None:
    """kvquant4, 2 heads x 20 dims: a key row is 10 code bytes + a 1-byte count, a value row 10 + fp16 zero and
    scale + 1 outlier (fp16 value, 1-byte index) = 17; a seat holds 1 sink (K and V, fp16) and
    floor(39 x 20 x 1%) = 7 key outliers (3 bytes each) per head."""
    spec = ModelSpec("t", (LayerAttention(FULL, 4, 2, 20, 20),))
    formats = cache_formats("kvquant4")
    assert kvquant_block_bytes(spec, formats, 8) == 8 * 2 * (11 + 17)
    assert kvquant_seat_bytes(spec, formats, 40) == 2 * 20 * 2 * 2 + 2 * 7 * 3


def test_a_pool_without_a_matching_calibration_says_so() -> None:
    with pytest.raises(CacheError, match="needs a KVQuant calibration"):
        pool("kvquant4", None)
    cal = calibration(bits=(3,))
    with pytest.raises(CacheError, match="codebooks for \\[3\\] bits"):
        pool("kvquant4", cal)
    with pytest.raises(CacheError, match="seats"):
        pool("kvquant3", cal, seats=0)
