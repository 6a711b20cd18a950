"""vLLM's start-up memory on a GPU, term by term, against the published logs it is calibrated on.

`Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py, 0.32.0):
    available_kv_cache_memory_bytes = requested_memory - profile_result.non_kv_cache_memory
                                      - cudagraph_memory_estimate_applied
with requested_memory = ceil(total_memory x gpu_memory_utilization) (`request_memory`) and
non_kv_cache_memory = weights + non-torch + the profile run's transient peak (`memory_profiling`).

Published logs:
- vLLM issue 10517 (RTX 3090, Llama-3.1-8B, V0, max_num_batched_tokens = max_model_len):
  "total_gpu_memory=23.58GiB ... kv_cache_size=3.81GiB" at 20,000 tokens, 2.89GiB at 29,000.
- vLLM PR 10511 (H100, Meta-Llama-3-8B, V0): total 79.22GiB, weights 14.96GiB, non_torch 1.79GiB,
  activation peak 1.26GiB, available_kv_cache_memory 53.29GiB.
- LMCache issue 3430 (RTX A5000, Qwen3-8B, vLLM 0.21, gpu_memory_utilization 0.9764, which the log
  says is 0.9543 without CUDA graphs: a 23.53 GiB card): "Estimated CUDA graph memory: 0.52 GiB
  total", "Available KV cache memory: 6.37 GiB".
"""

import json

import pytest

from kvlab.cli import main
from kvlab.plan.hardware import CATALOG, Device
from kvlab.plan.hf_config import spec_from_hf_config
from kvlab.plan.vllm_memory import capture_sizes, startup_budget
from kvlab.plan.vllm_versions import RELEASES

from test_hf_config import LLAMA3_8B

GIB = 2**30
LLAMA31_8B = dict(LLAMA3_8B, max_position_embeddings=131072)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, tie_word_embeddings=False)


def budget(config, card, utilization, tokens, seqs, version):
    spec = spec_from_hf_config(config, "m")
    return startup_budget(spec, card, spec.params_total * 2, RELEASES[version], utilization, tokens, seqs)


@pytest.mark.parametrize("tokens,logged", [(20_000, 3.81), (29_000, 2.89)])
def test_rtx_3090_log_available_memory_shrinks_with_the_profiled_batch(tokens, logged):
    table = budget(LLAMA31_8B, CATALOG["rtx-3090"], 0.9, tokens, 256, "0.19")  # no CUDA-graph term before 0.21
    assert table["available_bytes"] / GIB == pytest.approx(logged, abs=0.02)
    weights = next(term for term in table["terms"] if term["term"] == "weights")
    assert weights["kind"] == "exact" and weights["bytes"] / GIB == pytest.approx(14.9888, abs=0.0005)


def test_h100_log_within_the_stated_uncertainty():
    table = budget(LLAMA3_8B, CATALOG["h100-sxm"], 0.9, 8192, 256, "0.19")
    assert table["requested_bytes"] / GIB == pytest.approx(71.30, abs=0.01)
    assert table["available_bytes"] / GIB == pytest.approx(53.29, abs=0.45)


def test_cuda_graph_log_counts_its_graphs_and_lands_within_the_stated_uncertainty():
    pieces, full = capture_sizes(256, 8192)
    assert (len(pieces), pieces[-1], full) == (51, 512, 35)  # "PIECEWISE=51 (largest=512), FULL=35 (largest=256)"
    a5000 = Device("RTX A5000", 24 * 10**9, 768, 111, None, "test", int(23.53 * GIB), "LMCache issue 3430's log")
    table = budget(QWEN3_8B, a5000, 0.9764, 8192, 256, "0.32")
    graphs = next(term for term in table["terms"] if term["term"] == "CUDA graphs")
    assert graphs["bytes"] / GIB == pytest.approx(0.52, abs=0.02) and graphs["kind"] == "estimate"
    assert table["available_bytes"] / GIB == pytest.approx(6.37, abs=0.4)


def test_terms_say_which_are_estimates_and_add_up():
    table = budget(LLAMA3_8B, CATALOG["h100-sxm"], 0.9, 8192, 1024, "0.32")
    kinds = {term["term"]: term["kind"] for term in table["terms"]}
    assert kinds == {"weights": "exact", "activation peak": "estimate", "non-torch memory": "estimate",
                     "CUDA graphs": "estimate"}
    assert table["available_bytes"] == table["requested_bytes"] - sum(term["bytes"] for term in table["terms"])
    assert all(term["how"] for term in table["terms"])


def test_plan_and_export_use_the_budget_table_on_a_gpu(capsys, tmp_path):
    assert main(["plan", "llama-3-8b", "--gpu", "h100", "--engine", "vllm", "--context", "8192", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    table = result["vllm_startup"]
    assert result["cache_budget_bytes"] == table["available_bytes"]
    assert result["vllm"]["log_lines"][0] == f"Available KV cache memory: {round(table['available_bytes'] / GIB, 2)} GiB"
    assert table["max_num_batched_tokens"] == 8192 and table["max_num_seqs"] == 1024  # vllm serve on an H100
    assert main(["plan", "llama-3-8b", "--gpu", "h100", "--engine", "vllm"]) == 0
    shown = capsys.readouterr().out
    assert "start-up memory on H100 SXM" in shown and "= available KV cache memory" in shown and "estimate" in shown
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert main(["export", str(tmp_path), "--vllm", "--gpu", "h100", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["predicted_startup_memory"]["available_bytes"] < 0.9 * 79.22 * GIB - 14.96 * GIB


def test_the_cpu_backend_budget_is_exact():
    """No start-up table on vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE is the cache, exactly."""
    from kvlab.plan.planner import PlanRequest, plan
    result = plan(spec_from_hf_config(LLAMA3_8B, "m"), PlanRequest(engine="vllm", vllm_device="cpu",
                                                                   kv_cache_memory=2 * GIB))
    assert result["cache_budget_bytes"] == 2 * GIB and "vllm_startup" not in result
