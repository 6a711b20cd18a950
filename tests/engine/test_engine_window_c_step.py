"""The sinks + window policy (`--kv-window K --sink-tokens S`, StreamingLLM's) in the engine's C step:
greedy tokens equal the module path's, token for token up to near ties, while windows slide past
their sinks, blocks go back, requests join mid-flight and are preempted, and prefix caching is on.

Each layer's descriptor carries its group's window and sinks (csrc/llama_decode.c): a row attends
over the sinks the window has left behind (chunks of their own) and then its window, merged in one
softmax. Windows of 41 and 151 tokens with 4 and 130 sinks put the sinks in one chunk and in two
(CHUNK is 128), and a window wider than a chunk.
"""

import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import TIE
from kvlab.cache.window import make_window_cache
from test_engine_c_step import KIVI_LLAMA, needs_kernels, serve_twice

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import ggml_model  # noqa: E402
from test_sliding_layers import tiny_model  # noqa: E402


def windowed_margin(model, ids: list[int], want: int, got: int, dtype: str, kv_window: int, sinks: int) -> float:
    """The lab's sinks + window cache (kvlab.cache.window, the policy's reference) on `ids`: by how much
    its logits put `want` over `got` at the next position."""
    c = model.config
    cache = make_window_cache(dtype, c.n_layers, 1, c.kv_heads, c.head_size, c.head_size, len(ids) + 1, kv_window,
                              sinks, layer_windows=[c.window_of(i) for i in range(c.n_layers)])
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), cache)[0, -1]
    return float(logits[want] - logits[got])


def assert_same_tokens(model, work, module: dict, fused: dict, dtype: str, kv_window: int, sinks: int) -> None:
    """Token for token, or first apart where the windowed reference's two candidates tie (within TIE, plus
    what the cache format's rounding moves that margin by: engine_helpers.first_divergence_is_a_tie's rule,
    with the policy's own reference in place of a full cache's)."""
    for i, (prompt, _) in enumerate(work):
        got, want = fused[i], module[i]
        if got == want:
            continue
        at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert at < min(len(got), len(want)), (i, got, want)
        ids = prompt + want[:at]
        lead = windowed_margin(model, ids, want[at], got[at], dtype, kv_window, sinks)
        rounding = abs(lead - windowed_margin(model, ids, want[at], got[at], "fp32", kv_window, sinks))
        assert abs(lead) < TIE + rounding, (i, at, lead, got, want)


def prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    made = [torch.randint(1, KIVI_LLAMA.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    made[2][:64] = made[0][:64]  # a shared prefix of four 16-token blocks
    return made


@pytest.mark.parametrize("kv_cache_dtype,kv_window,sinks", [("fp16", 40, 4), ("int8", 40, 4), ("int4", 150, 130),
                                                            ("fp16", 150, 0)])
def test_sinks_and_window_in_c_equal_the_module_path(kv_cache_dtype, kv_window, sinks):
    needs_kernels()
    model = ggml_model(KIVI_LLAMA)
    work = list(zip(prompts([200, 60, 150, 20]), [150, 70, 120, 200]))
    module, fused, engine = serve_twice(model, work, kv_cache_dtype=kv_cache_dtype, block_size=16,
                                        max_num_batched_tokens=64, enable_prefix_caching=True, max_num_seqs=4,
                                        kv_window=kv_window, sink_tokens=sinks, kv_cache_memory=1_000_000)
    assert engine.runner.paged_step is not None
    assert {(g.window, g.sinks) for g in engine.pool.groups} == {(kv_window + 1, sinks)}
    assert max(len(p) + n for p, n in work) > 2 * (kv_window + 1)  # the windows slid
    assert_same_tokens(model, work, module, fused, kv_cache_dtype, kv_window, sinks)


def test_preempted_requests_under_a_window_in_c(kv_cache_dtype="fp16"):
    """A pool of 14 blocks (224 tokens) for four requests of up to 320: preemption recomputes in C."""
    needs_kernels()
    model = ggml_model(KIVI_LLAMA)
    work = list(zip(prompts([200, 60, 150, 20], seed=5), [120, 70, 90, 150]))
    per_block = 16 * KIVI_LLAMA.n_layers * 2 * KIVI_LLAMA.kv_heads * KIVI_LLAMA.head_size * 2
    module, fused, engine = serve_twice(model, work, kv_cache_dtype=kv_cache_dtype, block_size=16,
                                        max_num_batched_tokens=32, max_num_seqs=4, kv_window=40, sink_tokens=4,
                                        kv_cache_memory=14 * per_block)
    assert engine.blocks.num_blocks == 14
    assert engine.scheduler.num_preemptions > 0
    assert_same_tokens(model, work, module, fused, kv_cache_dtype, 40, 4)


def test_a_sliding_model_under_kv_window_in_c():
    """Gemma-shaped layers with their own 8-token windows and full layers: --kv-window 20 with 4 sinks
    narrows the full layers only (the sliding ones keep theirs, without sinks): two layouts in C."""
    from kvlab.nn.pack import pack_q8_0

    needs_kernels()
    model = pack_q8_0(tiny_model(max_seq_len=256, dim=64, head_dim=32, ffn_dim=96, embed_scale=8.0))
    work = [([1, 5, 7, 9, 11, 3, 2, 8, 40, 41, 42] * 4, 80), ([3, 4, 5], 90), ([9] * 7 + list(range(1, 8)), 60)]
    module, fused, engine = serve_twice(model, work, kv_cache_dtype="fp16", block_size=4, max_num_batched_tokens=16,
                                        kv_window=20, sink_tokens=4, kv_cache_memory=2_000_000)
    assert {(g.window, g.sinks) for g in engine.pool.groups} == {(21, 4), (model.config.sliding_window, 0)}
    assert_same_tokens(model, work, module, fused, "fp16", 20, 4)
