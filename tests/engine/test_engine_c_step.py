"""The engine's C paged step (kvlab.nn.paged_decode) decodes what the module path decodes, token for
token, for every KV format it serves: the same engine run twice over the same requests, once with
`paged_step=True` (decode steps in C) and once module by module, with requests joining mid-flight,
preemption (a pool too small for all of them) and prefix caching on or off. Prompts run module by
module in both, so the C step also reads blocks the module path wrote, and the module path those
it wrote after a preemption recomputes them.

A random Llama of GGUF-block weights (the C step runs those; stories260K's 172-wide MLP does not
pack into 32-value blocks) with 16-channel heads, and a Gemma-shaped one with 32: one group
per row in every group format. Rows of two groups are tests/nn/test_paged_decode.py's (-g8 pools).
"""

import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import assert_pool_free, collect, first_divergence_is_a_tie, greedy, make_engine, run_all
from kvlab.nn.config import ModelConfig
from kvlab.plan.kv_formats import C_STEP_KV_CACHE_DTYPES, resolve_kv_format

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import GQA, ggml_model  # noqa: E402
from test_sliding_layers import tiny_model  # noqa: E402

FORMATS = ["fp16", "fp8", "int8", "int4", "int2"]
LLAMA = ModelConfig(**{**GQA.to_dict(), "n_layers": 3, "max_seq_len": 128, "name": "gqa3"})
SHARED = [1, 5, 7, 9, 11, 3, 2, 8, 40, 41, 42, 43, 44]  # over three blocks of 4, that two later prompts extend
PROMPTS = [SHARED, [3, 4, 5], SHARED + [60, 61], [9] * 7 + list(range(1, 8)), SHARED + [70]]


class Ids:
    """A tokenizer for prompts given as ids (what first_divergence_is_a_tie encodes)."""

    @staticmethod
    def encode(ids: list[int]) -> list[int]:
        return list(ids)


def assert_same_tokens(model, work, module: dict, fused: dict, kv_cache_dtype: str) -> None:
    """Token for token, up to a near tie (engine_helpers.first_divergence_is_a_tie: the two paths sum
    in different orders, and an fp8 or integer code can round the other way); this random model's
    logits tie within 0.01 at places (an fp8 pool reaches one)."""
    for i, (prompt, _) in enumerate(work):
        assert first_divergence_is_a_tie(model, Ids, prompt, fused[i], module[i], kv_cache_dtype), \
            (i, fused[i], module[i])


def needs_kernels() -> None:
    from kvlab.nn.kernels import kernels

    if kernels() is None:
        pytest.skip("no C kernels on this machine")


def bytes_per_token(model, kv_cache_dtype: str) -> int:
    """The pool's bytes for one token of every layer (kvlab.plan's count)."""
    config, fmt = model.config, resolve_kv_format(kv_cache_dtype, "fp32")
    return config.n_layers * sum(fmt.bytes(side, config.kv_heads, config.head_size, 1) for side in ("k", "v"))


def serve_twice(model, work, **config) -> tuple[dict, dict, object]:
    """`work` [(prompt ids, max_tokens)] through a module-path engine and a C-step engine, request i
    joining after 3 i steps; each engine's outputs by request index, and the C-step engine."""
    outputs = []
    for paged_step in (False, True):
        engine = make_engine(model, None, paged_step=paged_step, **config)
        assert engine.decode_path == ("fused C step" if paged_step else "module by module")
        ids, got = [], {}
        for i, (prompt, n) in enumerate(work):
            ids.append(engine.add_request(prompt, greedy(n, ignore_eos=True)).request_id)
            for _ in range(3 * i):
                collect(engine.step(), got)
        run_all(engine, got)
        assert_pool_free(engine)
        outputs.append(({i: got[rid] for i, rid in enumerate(ids)}, engine))
    (module, _), (fused, engine) = outputs
    return module, fused, engine


@pytest.mark.parametrize("kv_cache_dtype,prefix_caching", [(name, True) for name in FORMATS] + [("int4", False)])
def test_c_step_equals_the_module_path_token_for_token(kv_cache_dtype, prefix_caching):
    needs_kernels()
    assert kv_cache_dtype in C_STEP_KV_CACHE_DTYPES
    model = ggml_model(LLAMA)
    work = list(zip(PROMPTS, [40, 25, 33, 50, 30]))
    module, fused, engine = serve_twice(model, work, kv_cache_dtype=kv_cache_dtype, block_size=4,
                                        max_num_batched_tokens=12, enable_prefix_caching=prefix_caching,
                                        kv_cache_memory=30 * 4 * bytes_per_token(model, kv_cache_dtype))
    assert engine.blocks.num_blocks == 30  # 120 tokens: the five requests cannot all fit at once
    assert_same_tokens(model, work, module, fused, kv_cache_dtype)
    assert engine.scheduler.num_preemptions > 0
    assert (engine.blocks.prefix_hits > 0) == prefix_caching


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "int2"])
def test_a_sliding_window_model_in_c_equals_the_module_path(kv_cache_dtype):
    """Gemma-shaped layers (sliding windows, q/k norms, post-norms, GeGLU) over a group-format pool,
    32-channel heads: windows slide and blocks go back in both engines alike."""
    from kvlab.nn.pack import pack_q8_0

    needs_kernels()
    model = pack_q8_0(tiny_model(max_seq_len=128, dim=64, head_dim=32, ffn_dim=96, embed_scale=8.0))
    prompts = [[1, 5, 7, 9, 11, 3, 2, 8, 40, 41, 42], [3, 4, 5], [9] * 7 + list(range(1, 8))]
    work = [(p, 40) for p in prompts]
    module, fused, engine = serve_twice(model, work, kv_cache_dtype=kv_cache_dtype, block_size=4,
                                        max_num_batched_tokens=8, kv_cache_memory=2_000_000)
    assert any(group.windowed for group in engine.pool.groups)
    assert_same_tokens(model, work, module, fused, kv_cache_dtype)


KIVI_LLAMA = ModelConfig(**{**LLAMA.to_dict(), "max_seq_len": 512, "name": "gqa3-512"})
KIVI_MEMORY = {"kivi4": 434_000, "kivi2": 411_000}  # 15 blocks of 32 tokens and three seats' rings: 480 tokens


@pytest.mark.parametrize("kv_cache_dtype", ["kivi4", "kivi2"])
def test_a_kivi_pool_in_c_equals_the_module_path(kv_cache_dtype):
    """KIVI's groups of 32 tokens quantised once they lie 128 back (csrc/kivi_attend.h), the newest in each
    seat's ring: prompts of up to 230 tokens in chunks of 64 (groups quantised from the ring and a chunk
    at once), decodes that quantise more, requests joining mid-flight and preempted (their seats and
    rings handed on), prefix caching asked for and left off (a prefix's residual sits in a seat)."""
    needs_kernels()
    model = ggml_model(KIVI_LLAMA)
    generator = torch.Generator().manual_seed(7)
    lengths = [230, 150, 40, 170]
    prompts = [torch.randint(1, KIVI_LLAMA.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    prompts[3][:100] = prompts[0][:100]  # a shared prefix, which a KIVI pool does not share
    work = list(zip(prompts, [60, 45, 150, 50]))
    module, fused, engine = serve_twice(model, work, kv_cache_dtype=kv_cache_dtype, block_size=32,
                                        max_num_batched_tokens=64, enable_prefix_caching=True, max_num_seqs=3,
                                        kv_cache_memory=KIVI_MEMORY[kv_cache_dtype])
    assert engine.pool.kivi is not None and engine.runner.paged_step is not None and engine.blocks.num_blocks == 15
    assert_same_tokens(model, work, module, fused, kv_cache_dtype)
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.prefix_hits == 0
    assert sorted(engine.blocks.free_seats) == [0, 1, 2]
