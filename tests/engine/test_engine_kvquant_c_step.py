"""KVQuant pools in the engine's C step: greedy tokens equal the module path's (itself the lab's
KVQuantCache's, tests/engine/test_engine_kvquant.py) and the lab's cache decoding each prompt alone, with
requests joining mid-flight and preemption (a pool too small for all of them: sequences are recomputed,
their seats' sinks and outliers written again); prompts run in C as rows too. Every block and seat is free
afterwards. tests/nn/test_paged_decode_kvquant.py holds the C writes to the pool's bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvlab.cache.kvquant import make_kvquant_cache
from kvlab.cache.kvquant_calibration import save_calibration
from kvlab.nn.generate import generate
from kvlab.plan.capacity import cache_formats, kv_fixed_bytes
from kvlab.plan.pool_capacity import kvquant_block_bytes, kvquant_seat_bytes
from kvquant_helpers import random_calibration
from needs import require_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_engine_c_step import LLAMA, PROMPTS, serve_twice  # noqa: E402
from test_c_model import ggml_model  # noqa: E402

SEATS = 3
TIE = 0.01


def is_a_tie(model, cal, prompt: list[int], got: list[int], want: list[int], kv_cache_dtype: str) -> bool:
    """`got` equals `want`, or first differs where the lab cache's two candidates lie within TIE: the C step
    sums in another order, and on a 3- or 4-bit grid a last-bit difference can move a code (this random
    model's logits tie within a thousandth at places)."""
    if got == want:
        return True
    at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    ids = prompt + want[:at]
    cache = make_kvquant_cache(kv_cache_dtype, cal, 1, len(ids), model.dtype, model.layer_ropes())
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), cache)[0, -1]
    return abs(float(logits[want[at]] - logits[got[at]])) < TIE


def lab_reference(model, cal, prompt: list[int], n: int, kv_cache_dtype: str) -> list[int]:
    cache = make_kvquant_cache(kv_cache_dtype, cal, 1, len(prompt) + n, model.dtype, model.layer_ropes())
    return generate(model, prompt, n, cache=cache)[0].tolist()


@pytest.mark.parametrize("kv_cache_dtype", ["kvquant4", "kvquant3"])
def test_c_step_equals_the_module_path_and_the_lab_cache(kv_cache_dtype, tmp_path):
    require_kernels()
    model = ggml_model(LLAMA)
    cal = random_calibration(model.config)
    path = tmp_path / "random.kvquant.safetensors"
    save_calibration(cal, path)
    spec, formats = model.config.to_plan_spec(), cache_formats(kv_cache_dtype, model_dtype="fp32")
    memory = 24 * kvquant_block_bytes(spec, formats, 4) + \
        SEATS * kvquant_seat_bytes(spec, formats, model.config.max_seq_len) + kv_fixed_bytes(spec, formats)
    work = list(zip(PROMPTS, [40, 25, 33, 50, 30]))
    module, fused, engine = serve_twice(model, work, kv_cache_dtype=kv_cache_dtype, kv_calibration=str(path),
                                        block_size=4, max_num_batched_tokens=12, max_num_seqs=SEATS,
                                        kv_cache_memory=memory)
    assert engine.blocks.num_blocks == 24  # 96 tokens: not all at once
    assert engine.scheduler.num_preemptions > 0
    assert sorted(engine.blocks.free_seats) == list(range(SEATS))
    module, fused = [module[i] for i in range(len(work))], [fused[i] for i in range(len(work))]
    assert sum(f == m for f, m in zip(fused, module)) >= 3
    assert all(is_a_tie(model, cal, prompt, f, m, kv_cache_dtype) for (prompt, _), f, m in zip(work, fused, module))
    assert module == [lab_reference(model, cal, prompt, n, kv_cache_dtype) for prompt, n in work]
