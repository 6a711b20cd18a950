"""KV groups in one pool: the engine serves sliding-window (Gemma 3) and MLA models token for token
as the module reference path decodes them alone, with requests joining mid-flight, preemption and
prefix caching on; windowed groups hand back what left their window; the pool is free afterwards
and its bytes and start-up lines are the plan's (kvlab.plan.vllm_blocks, vLLM's hybrid grouping).
"""

import sys
from pathlib import Path

import pytest
import torch

from kvlab.cache.kv_groups import RELEASED, KVGroup
from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.nn.config import SLIDING_ATTENTION, FULL_ATTENTION, ModelConfig
from kvlab.nn.generate import generate
from kvlab.nn.model import Decoder
from kvlab.plan.capacity import cache_formats
from kvlab.plan.vllm_blocks import vllm_capacity
from kvlab.plan.vllm_groups import kv_groups
from kvlab.plan.vllm_versions import DEFAULT_VERSION, release

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_sliding_layers import WINDOW, tiny_model  # noqa: E402

PROMPTS = [[1, 5, 7, 9, 11, 3, 2, 8, 40, 41, 42], [3, 4, 5], [9, 9, 9, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7],
           [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77]]
BLOCK = 4


def mla_model(**changes) -> Decoder:
    fields = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, attention="mla", kv_lora_rank=16, qk_rope_head_dim=8,
                  qk_nope_head_dim=8, v_head_dim=8, max_seq_len=128, name="tiny-mla")
    torch.manual_seed(0)
    return Decoder(ModelConfig(**{**fields, **changes})).eval()


def reference(model, ids: list[int], n: int, kv_cache_dtype: str = "auto") -> list[int]:
    cache = model.new_cache(1, len(ids) + n, kv_cache_dtype=kv_cache_dtype)
    return generate(model, ids, n, cache=cache)[0].tolist()


def engine(model, **config) -> LLMEngine:
    config = {"kv_cache_memory": 2_000_000, "block_size": BLOCK, "paged_step": False, "max_num_batched_tokens": 8, **config}
    return LLMEngine(model, None, EngineConfig(**config))


def serve(eng: LLMEngine, prompts, n: int, join_after: int = 3) -> tuple[list[list[int]], list[int]]:
    """Half the prompts at once, the rest after `join_after` steps; each request's ids and the
    blocks the engine held after every step."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    first, later = prompts[:len(prompts) // 2], prompts[len(prompts) // 2:]
    ids = [eng.add_request(p, params).request_id for p in first]
    got, held, steps = {}, [], 0
    with torch.inference_mode():
        while eng.has_unfinished() or later:
            if steps == join_after and later:
                ids += [eng.add_request(p, params).request_id for p in later]
                later = []
            for delta in eng.step():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
            held.append(eng.blocks.num_blocks - eng.blocks.num_free)
            steps += 1
    return [got[i] for i in ids], held


def assert_free(eng: LLMEngine) -> None:
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert all(block.ref_count == 0 for block in eng.blocks.blocks)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8", "int4"])
def test_sliding_window_model_equals_the_reference(kv_cache_dtype):
    model = tiny_model(max_seq_len=128)
    want = [reference(model, p, 40, kv_cache_dtype) for p in PROMPTS]
    eng = engine(model, kv_cache_dtype=kv_cache_dtype)
    assert [group.window for group in eng.pool.groups] == [WINDOW, WINDOW, None]
    got, _ = serve(eng, PROMPTS, 40)
    assert got == want
    assert max(len(p) for p in PROMPTS) + 40 > 4 * WINDOW  # the windows really slid
    assert_free(eng)


def test_mla_model_equals_the_reference():
    model = mla_model()
    want = [reference(model, p, 30) for p in PROMPTS]
    eng = engine(model)
    assert eng.pool.is_latent and eng.pool.kv_heads == 1 and eng.pool.k_head_dim == 16 + 8
    got, _ = serve(eng, PROMPTS, 30)
    assert got == want
    assert_free(eng)


def test_preemption_and_prefix_caching_keep_the_outputs():
    """A pool too small for every request at once preempts (recompute); a shared prefix is served
    from the cache in the full group and, for the sliding groups, only its last window."""
    model = tiny_model(max_seq_len=128)
    shared = list(range(20, 44))  # 24 tokens: six blocks, past the window of 6
    prompts = [shared + [50 + i] for i in range(4)] + PROMPTS[:2]
    want = [reference(model, p, 24) for p in prompts]
    page = 1 * BLOCK * 16 * 4  # per layer and block: one KV head of 16 channels, K and V, fp32
    eng = engine(model, kv_cache_memory=60 * page, max_num_seqs=8)
    got, held = serve(eng, prompts, 24, join_after=6)
    assert got == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.prefix_hits > 0
    assert max(held) <= eng.blocks.num_blocks
    assert_free(eng)


def test_a_sliding_group_holds_only_its_window():
    model = tiny_model(max_seq_len=128)
    eng = engine(model)
    request = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    seq = eng.requests[request.request_id][0]
    with torch.inference_mode():
        for _ in range(40):
            eng.step()
    sliding = [table for group, table in zip(eng.pool.groups, seq.block_tables) if group.windowed]
    full = [table for group, table in zip(eng.pool.groups, seq.block_tables) if not group.windowed]
    assert all(RELEASED not in table for table in full)
    for table in sliding:  # the window and the step's block, nothing older
        assert sum(block != RELEASED for block in table) <= -(-(WINDOW - 1) // BLOCK) + 2
        assert table[0] == RELEASED
    eng.abort(request.request_id)
    assert_free(eng)


def test_a_broken_window_changes_the_output():
    """The engine's windows are what decide the text: a group that sees one position too many differs."""
    model = tiny_model(max_seq_len=128)
    want = [reference(model, p, 40) for p in PROMPTS]
    eng = engine(model)
    eng.pool.groups = [KVGroup(group.layers, WINDOW + 1) if group.windowed else group for group in eng.pool.groups]
    got, _ = serve(eng, PROMPTS, 40)
    assert got != want


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8"])
@pytest.mark.parametrize("make", [lambda: tiny_model(max_seq_len=128), mla_model,
                                  lambda: tiny_model(max_seq_len=128, layer_types=(SLIDING_ATTENTION,) * 5
                                                     + (FULL_ATTENTION,), n_layers=6)])
def test_pool_bytes_and_start_up_lines_are_the_plans(make, kv_cache_dtype):
    model = make()
    budget = 1_000_000
    eng = engine(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=budget)
    plan = vllm_capacity(model.config.to_plan_spec(), budget, eng.max_model_len, cache_formats(kv_cache_dtype,
                         model_dtype="fp32"), BLOCK, device="cpu", max_num_batched_tokens=8)
    assert eng.capacity_lines == plan["log_lines"]
    assert eng.pool.nbytes() == plan["num_gpu_blocks"] * plan["block_bytes_all_layers"]
    groups = kv_groups(model.config.to_plan_spec(), cache_formats("fp16"), BLOCK, 1, True, release(DEFAULT_VERSION))
    assert [group.layers for group in eng.pool.groups] == [group.layer_ids for group in groups]


@pytest.mark.parametrize("kv_cache_dtype", ["kivi4", "kivi2"])
def test_kivi_pool_equals_the_lab_kivi_cache(stories_model, stories_tokenizer, kv_cache_dtype):
    """Quantised blocks plus a residual per seat hold KiviCache's codes: the same greedy tokens, and
    the pool's bytes are the plan's blocks plus the seats' rings."""
    from kvlab.plan.pool_capacity import kivi_block_bytes, kivi_seat_bytes

    model = stories_model
    prompts = [list(range(1, 40)), list(range(100, 300)), [5, 6, 7]]
    want = [reference(model, p, 90, kv_cache_dtype) for p in prompts]
    eng = engine(model, kv_cache_dtype=kv_cache_dtype, block_size=32, max_num_batched_tokens=64, max_num_seqs=3)
    got, _ = serve(eng, prompts, 90)
    assert got == want
    formats = cache_formats(kv_cache_dtype, model_dtype="fp32")
    spec = model.config.to_plan_spec()
    assert eng.pool.nbytes() == eng.blocks.num_blocks * kivi_block_bytes(spec, formats, 32) + \
        3 * kivi_seat_bytes(spec, formats)
    assert_free(eng)
    assert sorted(eng.blocks.free_seats) == [0, 1, 2]


def test_sliding_window_model_in_c_equals_the_module_path():
    """The C step runs the Gemma-shaped model over its KV groups (every row at its own position,
    released blocks skipped) as the module path does: the same greedy tokens, the pool free after."""
    from kvlab.nn.kernels import kernels
    from kvlab.nn.pack import pack_q8_0

    if kernels() is None:
        pytest.skip("no C kernels on this machine")
    model = pack_q8_0(tiny_model(max_seq_len=128, dim=64, head_dim=32, ffn_dim=96, embed_scale=8.0))
    module = engine(model, paged_step=False)
    fused = engine(model, paged_step=True)
    assert fused.decode_path == "fused C step" and module.decode_path == "module by module"
    want, _ = serve(module, PROMPTS, 40)
    got, _ = serve(fused, PROMPTS, 40)
    assert got == want
    assert_free(fused)
