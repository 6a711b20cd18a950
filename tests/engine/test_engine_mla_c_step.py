"""The engine serves MLA models in the C step (csrc/mla_attend.h) token for token as module by module:
the same requests through a module-path engine and a C-step engine, joining mid-flight, with
preemption (a pool too small for all of them) and prefix caching, for kvlab's exact conversion of a
GQA model at full rank, a truncated one and a DeepSeek-shaped model (one shared RoPE key, a latent
norm); the pool is 100% free after each. The models are tests/nn/test_paged_decode_mla.py's.
"""

import sys
from pathlib import Path

import pytest

from kvlab.cache.pool import KVPool
from kvlab.nn.pack import pack_q8_0
from test_engine_c_step import PROMPTS, assert_same_tokens, needs_kernels, serve_twice

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_paged_decode_mla import mla_model  # noqa: E402


def bytes_per_token(model, kv_cache_dtype: str) -> int:
    """The latent pool's bytes for one token of every layer (a one-block pool's, which the plan counts)."""
    return KVPool.for_model(model.config, 1, 4, kv_cache_dtype).nbytes() // 4


@pytest.mark.parametrize("kind,kv_cache_dtype", [("full", "fp16"), ("truncated", "fp8"), ("deepseek", "fp16"),
                                                 ("deepseek", "auto")])
def test_mla_in_c_equals_the_module_path_token_for_token(kind, kv_cache_dtype):
    needs_kernels()
    model = pack_q8_0(mla_model(kind))
    work = list(zip(PROMPTS, [40, 25, 33, 50, 30]))
    module, fused, engine = serve_twice(model, work, kv_cache_dtype=kv_cache_dtype, block_size=4,
                                        max_num_batched_tokens=12, enable_prefix_caching=True,
                                        kv_cache_memory=30 * 4 * bytes_per_token(model, kv_cache_dtype))
    assert engine.pool.is_latent and engine.blocks.num_blocks == 30
    assert_same_tokens(model, work, module, fused, kv_cache_dtype)
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.prefix_hits > 0
