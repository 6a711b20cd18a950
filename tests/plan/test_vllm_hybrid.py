"""`--engine vllm` on hybrid models: vLLM's hybrid KV-cache manager rule, its CPU backend, per-request usage.

The rule is vLLM's (main at commit 001cabc1be16, v1/core/kv_cache_utils.py and
v1/kv_cache_interface.py): pages unified to the largest, layers grouped by kind into groups
of equal size, num_blocks = budget // page // group_size, logged tokens = num_blocks //
groups x the smallest block size. Each expected figure below is written out from that rule
for the model's real config, not computed by the code under test. The CPU line is the one
measured on this machine (../shared/reference/ANCHORS.md: vLLM 0.32 CPU, SmolLM2 in bf16,
VLLM_CPU_KVCACHE_SPACE=2: "CPU KV cache size: 93,184 tokens ... 45.50x").
"""

import json

import pytest

from kvlab.cli import main
from kvlab.plan.capacity import cache_formats
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_config import spec_from_hf_config
from kvlab.plan.presets import preset
from kvlab.plan.vllm_blocks import vllm_capacity

from test_hf_config import GEMMA3_1B, GPT_OSS_20B
from test_hf_mixed import GEMMA4_31B

GIB = 2**30
BF16 = cache_formats("auto", model_dtype="bf16")


def cdiv(a, b):
    return -(-a // b)


def capacity(config, budget, max_model_len, **kwargs):
    return vllm_capacity(spec_from_hf_config(config, "m"), budget, max_model_len, BF16, **kwargs)


def test_gpt_oss_two_equal_groups_log_dense_capacity_but_a_request_holds_its_window():
    page = 16 * 2 * 8 * 64 * 2  # 16 tokens of K and V, 8 KV heads of 64, bf16: every layer alike
    vllm = capacity(GPT_OSS_20B, 10 * GIB, 8192, max_num_batched_tokens=2048)
    assert [(g["kind"], g["window"], g["layers"]) for g in vllm["kv_cache_groups"]] == \
        [("sliding", 128, 12), ("full", None, 12)]
    blocks = 10 * GIB // page // 12  # one block id = a page in each of the 12 shared tensors
    assert vllm["num_gpu_blocks"] == blocks == 27306
    assert vllm["gpu_kv_cache_tokens"] == blocks // 2 * 16 == 218_448  # = all 24 layers counted as full
    # peak per request: full 8192/16 blocks, sliding cdiv(127 + 2048, 16) + 1
    assert vllm["max_concurrency"] == pytest.approx(blocks / (512 + cdiv(127 + 2048, 16) + 1))
    assert vllm["log_lines"][2] == "Maximum concurrency for 8,192 tokens per request: 42.07x"
    # at 8,192 computed tokens the sliding group has freed the blocks before token 8192 - 127
    assert vllm["request_blocks"] == 512 + (512 - (8192 - 127) // 16)
    assert vllm["request_bytes"] == vllm["request_blocks"] * 12 * page
    assert vllm["requests_that_fit"] == blocks // vllm["request_blocks"] == 52


def test_gemma3_five_to_one_is_padded_into_groups_of_the_global_count():
    page = 16 * 2 * 1 * 256 * 2
    vllm = capacity(GEMMA3_1B, 4 * GIB, 32768, max_num_batched_tokens=8192)
    groups = vllm["kv_cache_groups"]
    # 22 sliding + 4 full layers: groups of 4, so 6 sliding groups (4,4,4,4,3,3: two padding layers) + 1 full
    assert [g["layers"] for g in groups] == [4, 4, 4, 4, 3, 3, 4] and vllm["padding_layers"] == 2
    blocks = 4 * GIB // page // 4
    assert vllm["num_gpu_blocks"] == blocks
    assert vllm["gpu_kv_cache_tokens"] == blocks // 7 * 16
    peak = 6 * (cdiv(511 + 8192, 16) + 1) + cdiv(32768, 16)
    assert vllm["max_concurrency"] == pytest.approx(blocks / peak)
    assert vllm["request_blocks"] == 6 * (2048 - (32768 - 511) // 16) + 2048


def test_gemma4_mixed_head_sizes_unify_pages_by_doubling_the_global_block():
    sliding_page, global_page = 16 * 2 * 16 * 256 * 2, 16 * 2 * 4 * 512 * 2
    assert sliding_page == 2 * global_page
    vllm = capacity(GEMMA4_31B, 40 * GIB, 65536, max_num_batched_tokens=8192)
    assert [(g["kind"], g["block_size"], g["page_bytes"], g["layers"]) for g in vllm["kv_cache_groups"]] == \
        [("sliding", 16, sliding_page, 10)] * 5 + [("full", 32, sliding_page, 10)]
    blocks = 40 * GIB // sliding_page // 10
    assert vllm["num_gpu_blocks"] == blocks
    assert vllm["gpu_kv_cache_tokens"] == blocks // 6 * 16  # the smallest block size
    peak = 5 * (cdiv(1023 + 8192, 16) + 1) + 65536 // 32
    assert vllm["max_concurrency"] == pytest.approx(blocks / peak)


def test_page_sizes_that_do_not_divide_are_refused_as_vllm_refuses_them():
    text = dict(GEMMA4_31B["text_config"], num_global_key_value_heads=3, num_attention_heads=48)
    with pytest.raises(PlanError, match="cannot unify page sizes"):
        capacity(text, 40 * GIB, 4096)


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
    assert cpu["log_lines"][1:] == ["CPU KV cache size: 93,184 tokens",
                                    "Maximum concurrency for 2,048 tokens per request: 45.50x"]
    cuda = vllm_capacity(smollm2, 2 * GIB, 2048, BF16)
    assert cuda["log_lines"][1] == "GPU KV cache size: 93,200 tokens"


def test_cli_cpu_budget_from_the_environment_and_bad_input(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    argv = ["plan", "smollm2-135m", "--dtype", "bf16", "--engine", "vllm", "--vllm-device", "cpu", "--context", "2048"]
    assert main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["vllm"]["gpu_kv_cache_tokens"] == 93_184 and result["cache_budget_bytes"] == 2 * GIB
    assert main(argv) == 0
    assert "CPU KV cache size: 93,184 tokens" in capsys.readouterr().out
    for value in ("two", "-1"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "VLLM_CPU_KVCACHE_SPACE" in err and err.count("\n") == 1
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # unset (or 0): vLLM's CPU platform takes 4 GiB and warns
    assert main(argv + ["--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["cache_budget_bytes"] == 4 * GIB and "4 GiB" in captured.err
    assert main(["plan", "smollm2-135m", "--vllm-device", "cpu", "--kv-cache-memory", "2GiB"]) == 2
    assert "--engine vllm" in capsys.readouterr().err


def test_cli_default_batched_tokens_follow_the_card(capsys):
    h100 = json.loads(_run(capsys, "--gpu", "h100-sxm"))["vllm"]
    l4 = json.loads(_run(capsys, "--gpu", "l4"))["vllm"]
    assert (h100["max_num_batched_tokens"], l4["max_num_batched_tokens"]) == (8192, 2048)
    fixed = json.loads(_run(capsys, "--gpu", "l4", "--max-num-batched-tokens", "512"))["vllm"]
    assert fixed["max_num_batched_tokens"] == 512
    off = json.loads(_run(capsys, "--gpu", "l4", "--disable-hybrid-kv-cache-manager"))["vllm"]
    assert len(off["kv_cache_groups"]) == 1 and not off["hybrid_kv_cache_manager"] and len(l4["kv_cache_groups"]) > 1


def _run(capsys, *argv):
    assert main(["plan", "gemma-3-270m", "--engine", "vllm", "--context", "8192", "--json", *argv]) == 0
    return capsys.readouterr().out


def test_llama4_chunked_layers_group_three_to_one_and_free_all_but_the_current_chunk():
    from test_hf_mixed import LLAMA4_SCOUT
    page = 16 * 2 * 8 * 128 * 2
    vllm = capacity(LLAMA4_SCOUT, 40 * GIB, 131072, max_num_batched_tokens=8192)
    assert [(g["kind"], g["window"], g["layers"]) for g in vllm["kv_cache_groups"]] == \
        [("chunked", 8192, 12)] * 3 + [("full", None, 12)]
    blocks = 40 * GIB // page // 12
    assert vllm["gpu_kv_cache_tokens"] == blocks // 4 * 16
    assert vllm["max_concurrency"] == pytest.approx(blocks / (3 * cdiv(8192 + 8192, 16) + 131072 // 16))
    # at 131,072 tokens a chunked group keeps only the current chunk: 131072 // 8192 * 8192 skipped, nothing held
    assert vllm["request_blocks"] == 131072 // 16
    assert capacity(LLAMA4_SCOUT, 40 * GIB, 100_000)["request_blocks"] == 6250 + 3 * (6250 - 98304 // 16)


def test_hybrid_manager_off_allocates_windowed_layers_as_full():
    page = 16 * 2 * 8 * 64 * 2
    off = capacity(GPT_OSS_20B, 10 * GIB, 8192, max_num_batched_tokens=2048, hybrid=False)
    assert off["kv_cache_groups"] == [dict(kind="full", window=None, layers=24, block_size=16, page_bytes=24 * page)]
    assert off["num_gpu_blocks"] == 10 * GIB // (24 * page) and off["gpu_kv_cache_tokens"] == off["num_gpu_blocks"] * 16
    assert off["max_concurrency"] == off["num_gpu_blocks"] / 512 and off["request_blocks"] == 512


def test_state_layers_are_refused_in_vllm_mode():
    from test_hf_mixed import QWEN3_NEXT_80B
    with pytest.raises(PlanError, match="--engine kvlab"):
        capacity(QWEN3_NEXT_80B, 40 * GIB, 4096)
