"""Speculation on the C paged step: verification as one row per fed token, the self-draft as the
C step cut to the first layers, a trained (dense) draft packed to Q8_0 and run as its own C step.
Greedy output must be the output without speculation, and the pool must end empty."""

import sys
from pathlib import Path

import pytest
import torch

from kvlab.checkpoints.hf import save_hf
from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from engine_helpers import assert_pool_free, run_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import GQA, ggml_model  # noqa: E402

from needs import require_kernels

TARGET = ModelConfig(**{**GQA.to_dict(), "max_seq_len": 128, "n_layers": 3, "name": "target"})
DRAFT = ModelConfig(vocab_size=GQA.vocab_size, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                    max_seq_len=128, tie_embeddings=True, name="draft")
PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7]]


@pytest.fixture(scope="module")
def target():
    require_kernels()
    return ggml_model(TARGET)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    torch.manual_seed(3)
    directory = tmp_path_factory.mktemp("draft") / "tiny-draft"
    save_hf(Decoder(DRAFT).eval(), str(directory))
    return str(directory)


def outputs(model, spec=None, prompts=PROMPTS, max_tokens=20):
    engine = LLMEngine(model, None, EngineConfig(kv_cache_memory=2_000_000, block_size=4, max_num_seqs=8,
                                                 speculative_config=spec))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), request_id=f"r{i}")
    got = run_all(engine)
    assert_pool_free(engine)
    return engine, got


@pytest.mark.parametrize("method", ["self", "ngram", "draft_model"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_on_the_c_step_is_the_output_without(target, draft_dir, method, batch):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = draft_dir
    if method == "self":
        spec["num_layers"] = 1
    _, want = outputs(target, None, PROMPTS[:batch])
    engine, got = outputs(target, spec, PROMPTS[:batch])
    assert engine.decode_path == "fused C step" and engine.runner.draft_step is not None or method == "ngram"
    assert got == want
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens


def test_prompts_past_the_crossover_run_on_the_library_and_decode_the_same(target, monkeypatch):
    """Prompt steps whose rows pass the crossover run module by module with library products (the
    exact dense weights); decode steps of one row stay in the fused C step, of more take the hybrid
    step (tests/engine/test_engine_hybrid_step.py). The tokens are the all-C run's."""
    _, want = outputs(target)
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "library")
    engine, got = outputs(target)
    assert engine.runner._on_library(8) and not engine.runner._on_library(1)
    assert got == want
