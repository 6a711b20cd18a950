"""The engine's hybrid decode step (kvlab.nn.hybrid_step: products in the library, attention in C over
the pool) decodes what the fused C step decodes, and the runner takes it only where the step's rows
are at or above the crossover (kvlab.nn.matmul_backend). KVLAB_MATMUL_BACKEND=library forces it from
2 rows on (on this project's AVX2 machines the measured crossover never picks it); `kernels`, and
`auto` below the crossover, keep the fused step. The runner's choice is tested, never its speed."""

import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import assert_pool_free, collect, first_divergence_is_a_tie, greedy, make_engine, run_all
from kvlab.engine import SamplingParams
from kvlab.nn import matmul_backend as mb
from kvlab.nn.config import ModelConfig
from kvlab.nn.hybrid_step import HybridDecodeStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import ggml_model  # noqa: E402

from needs import require_kernels, require_smollm2

# SmolLM2-135M's layer shape (576 wide, 9 query heads of 64 channels over 3 KV heads, a 1,536-wide MLP), two layers
SMOL = ModelConfig(vocab_size=256, dim=576, n_layers=2, n_heads=9, n_kv_heads=3, ffn_dim=1536, max_seq_len=256,
                   tie_embeddings=True, name="smollm2-shaped")
PROMPTS = [[1, 5, 7, 9, 11, 3, 2, 8, 40, 41, 42, 43, 44], [3, 4, 5], [9] * 7 + list(range(1, 8)), [60, 61, 62, 63, 64],
           [5, 9, 12, 5, 9, 12, 5, 9], [100, 101]]


class Ids:
    @staticmethod
    def encode(ids: list[int]) -> list[int]:
        return list(ids)


@pytest.fixture(scope="module")
def smol():
    require_kernels()
    return ggml_model(SMOL)


def counted(engine) -> list[int]:
    """The rows of every call the engine's hybrid step runs, recorded as it runs."""
    step, rows = engine.runner.hybrid_step, []
    run = step._run

    def spy(ids, *args, **kwargs):
        rows.append(int(ids.numel()))
        return run(ids, *args, **kwargs)

    step._run = spy
    return rows


def serve(model, backend, monkeypatch, spec=None, **config):
    """The prompts through one engine, request i joining after 2 i steps; its outputs by index, the engine
    and the row counts of its hybrid steps."""
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", backend)
    config = {"kv_cache_memory": 2_000_000, "block_size": 4, "paged_step": True, "max_num_batched_tokens": 16,
              "speculative_config": spec, **config}
    engine = make_engine(model, None, **config)
    rows = counted(engine) if engine.runner.hybrid_step is not None else []
    ids, got = [], {}
    for i, prompt in enumerate(PROMPTS):
        ids.append(engine.add_request(prompt, greedy(16, ignore_eos=True)).request_id)
        for _ in range(2 * i):
            collect(engine.step(), got)
    run_all(engine, got)
    assert_pool_free(engine)
    return [got[rid] for rid in ids], engine, rows


def assert_same_tokens(model, got, want, kv_cache_dtype="auto"):
    for prompt, a, b in zip(PROMPTS, got, want):
        assert first_divergence_is_a_tie(model, Ids, prompt, a, b, kv_cache_dtype), (prompt, a, b)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8"])
def test_hybrid_decode_equals_the_fused_step_with_joins_and_preemption(smol, monkeypatch, kv_cache_dtype):
    from kvlab.plan.kv_formats import resolve_kv_format

    fmt = resolve_kv_format(kv_cache_dtype, "fp32")
    per_token = SMOL.n_layers * sum(fmt.bytes(side, SMOL.kv_heads, SMOL.head_size, 1) for side in ("k", "v"))
    small = {"kv_cache_dtype": kv_cache_dtype, "kv_cache_memory": 24 * 4 * per_token}  # 24 blocks: not all fit
    want, _, fused_rows = serve(smol, "kernels", monkeypatch, **small)
    got, engine, rows = serve(smol, "library", monkeypatch, **small)
    assert engine.blocks.num_blocks == 24 and engine.scheduler.num_preemptions > 0
    assert not fused_rows  # kernels: never the hybrid step
    assert rows and min(rows) >= 2 and max(rows) > 2  # every decode of two or more sequences, none of one
    assert_same_tokens(smol, got, want, kv_cache_dtype)


def test_verification_rides_on_the_hybrid_step(smol, monkeypatch):
    """n-gram drafts verified as k + 1 rows a sequence through the hybrid step: greedy output is the output
    without speculation, and every verification of two rows or more took the hybrid step."""
    want, _, _ = serve(smol, "kernels", monkeypatch)
    got, engine, rows = serve(smol, "library", monkeypatch, spec={"method": "ngram", "num_speculative_tokens": 3})
    assert engine.spec_stats.num_drafts > 0 and rows
    assert_same_tokens(smol, got, want)


def test_the_runner_chooses_by_the_rows_and_the_setting(smol, monkeypatch):
    """kernels: the fused step at every row count; library: the hybrid step from 2 rows; auto: from the
    crossover (set here, not timed); one row always the fused step."""
    engine = make_engine(smol, None, paged_step=True, kv_cache_memory=2_000_000, block_size=4)
    runner = engine.runner
    assert isinstance(runner.hybrid_step, HybridDecodeStep)
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "kernels")
    assert all(runner.decode_step(rows) is runner.paged_step for rows in (1, 2, 16, 32))
    assert runner.hybrid_from() is None and "the fused C step at every row count" in engine.products_line
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "library")
    assert runner.decode_step(1) is runner.paged_step
    assert runner.decode_step(2) is runner.decode_step(32) is runner.hybrid_step
    assert runner.hybrid_from() == 2 and "from 2 the hybrid step" in engine.products_line
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "auto")
    monkeypatch.setitem(mb._MEASURED, mb._key(runner.probe_layer()), 16)
    assert [runner.decode_step(rows) is runner.hybrid_step for rows in (1, 8, 15, 16, 32)] == \
        [False, False, False, True, True]
    assert runner.hybrid_from() == 16 and "fused C step below 16 rows" in engine.products_line


def test_no_hybrid_step_without_a_fused_one(smol, monkeypatch):
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "library")
    engine = make_engine(smol, None, paged_step=False, kv_cache_memory=2_000_000, block_size=4)
    assert engine.runner.hybrid_step is None and engine.decode_path == "module by module"


@pytest.mark.slow
def test_smollm2_decodes_the_same_through_the_hybrid_step(monkeypatch):
    """The real SmolLM2-135M (Q4_1 blocks), four requests: the same greedy tokens both ways (up to a tie)."""
    require_smollm2()
    from kvlab.engine.llm import load_for_engine

    model, tokenizer = load_for_engine("smollm2-135m", "gguf")
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    outputs = []
    for backend in ("kernels", "library"):
        monkeypatch.setenv("KVLAB_MATMUL_BACKEND", backend)
        engine = make_engine(model, tokenizer, paged_step=True, kv_cache_memory=64 << 20)
        rows = counted(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16), request_id=f"r{i}")
        with torch.inference_mode():
            got = run_all(engine)
        assert_pool_free(engine)
        assert bool(rows) == (backend == "library")
        outputs.append([got[f"r{i}"] for i in range(len(prompts))])
    for prompt, want, got in zip(prompts, *outputs):
        assert first_divergence_is_a_tie(model, tokenizer, prompt, got, want), (prompt, got, want)
