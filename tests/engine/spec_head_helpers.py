"""Shared by the draft-head speculation tests (EAGLE, Medusa): the small target, its prompts, and one run of
an engine over them that leaves its pool empty."""

import sys
from pathlib import Path

from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from engine_helpers import assert_pool_free, run_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import GQA, ggml_model  # noqa: E402

from needs import require_kernels  # noqa: E402

TARGET = ModelConfig(**{**GQA.to_dict(), "max_seq_len": 128, "n_layers": 3, "name": "target"})
PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7]]


def outputs(model, spec=None, prompts=PROMPTS, max_tokens=20, paged_step=True, temperature=0.0, **config):
    """(engine, every request's output) after running `prompts` to the end, with `spec` as its
    speculative_config; the pool is checked free after (rolled-back slots included)."""
    settings = dict(kv_cache_memory=2_000_000, block_size=4, max_num_seqs=8, speculative_config=spec, paged_step=paged_step,
                    max_num_batched_tokens=16)
    engine = LLMEngine(model, None, EngineConfig(**{**settings, **config}))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i),
                           request_id=f"r{i}")
    got = run_all(engine)
    assert_pool_free(engine)
    return engine, got


def greedy_with_and_without(spec: dict, batch: int, paged_step: bool):
    """(engine with `spec`, its greedy outputs, the outputs without speculation) for the first `batch`
    prompts, on the C step (GGUF blocks) or module by module, the engine checked to have run that path."""
    if paged_step:
        require_kernels()
    model = ggml_model(TARGET) if paged_step else Decoder(TARGET).eval()
    _, want = outputs(model, None, PROMPTS[:batch], paged_step=paged_step)
    engine, got = outputs(model, spec, PROMPTS[:batch], paged_step=paged_step)
    assert engine.decode_path == ("fused C step" if paged_step else "module by module")
    return engine, got, want
