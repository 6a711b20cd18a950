"""`kvlab plan` from the outside: JSON keys, errors, warnings, and that the planner stays pure Python."""

import json
import subprocess
import sys

import pytest

from kvlab.cli import main
from needs import STORIES, require_file

CARD_KEYS = {"cache_budget_bytes", "seats", "max_context", "decode_ms_per_token", "decode_tokens_per_s",
             "prefill_ms", "binding_limit", "kv_cache_tokens"}


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_promised_keys_and_sources(capsys):
    result = run_json(capsys, "llama-3-8b", "--gpu", "h100-sxm", "--context", "8192", "--batch", "4")
    assert {"kv_bytes_per_token", "kv_bytes_per_sequence", "weight_bytes"} | CARD_KEYS <= result.keys()
    assert result["kv_bytes_per_sequence"] == 2**30
    assert "datasheet" in result["hardware"]["source"]
    assert result["inputs"]["context"] == 8192 and result["inputs"]["batch"] == 4
    assert result["seats"] * result["kv_bytes_per_sequence"] <= result["cache_budget_bytes"]


def test_budget_without_card_gives_tokens_and_seats(capsys):
    result = run_json(capsys, "--layers", "40", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
                      "--kv-cache-memory", "9GiB")
    assert result["kv_cache_tokens"] == 9 * 2**30 // 163_840
    assert result["seats"] == 14 and "concurrency" not in result  # one name per quantity: seats
    assert "decode_ms_per_token" not in result


def test_vllm_engine_rounds_to_blocks_and_prints_its_lines(capsys):
    result = run_json(capsys, "llama-3-8b", "--kv-cache-memory", "10GiB", "--engine", "vllm", "--context", "8192")
    vllm = result["vllm"]
    assert vllm["num_gpu_blocks"] == 10 * 2**30 // (2 * 16 * 8 * 128 * 2) // 32
    assert vllm["gpu_kv_cache_tokens"] == vllm["num_gpu_blocks"] * 16
    assert vllm["log_lines"][1] == (f"GPU KV cache size: {vllm['gpu_kv_cache_tokens']:,} tokens, "
                                    "Maximum concurrency for 8,192 tokens per request: 10.00x")
    assert result["seats"] == 10 and "kv_cache_tokens" not in result  # vLLM's figures, not a second set


def test_tensor_parallel_splits_kv_heads_and_replicates_when_tp_exceeds_them(capsys):
    one = run_json(capsys, "llama-3-8b")
    four = run_json(capsys, "llama-3-8b", "--tensor-parallel-size", "4")
    sixteen = run_json(capsys, "llama-3-8b", "--tensor-parallel-size", "16")
    assert four["kv_bytes_per_token"] * 4 == one["kv_bytes_per_token"]
    assert sixteen["kv_heads_per_rank"] == 1
    assert sixteen["kv_bytes_per_token"] * 8 == one["kv_bytes_per_token"]
    mla_one = run_json(capsys, "deepseek-v2")
    mla_eight = run_json(capsys, "deepseek-v2", "--tensor-parallel-size", "8")
    assert mla_eight["kv_bytes_per_token"] == mla_one["kv_bytes_per_token"]


def test_what_if_overrides(capsys):
    mqa = run_json(capsys, "llama-2-7b", "--kv-heads", "1")
    assert mqa["kv_bytes_per_token"] == 2 * 32 * 128 * 2
    mla = run_json(capsys, "llama-2-7b", "--mla-rank", "512", "--mla-rope-dim", "64")
    assert mla["kv_bytes_per_token"] == 32 * 576 * 2


def test_compare_table_json(capsys):
    result = run_json(capsys, "llama-2-70b", "--compare", "mha,gqa:8,mqa,mla", "--compare-dtypes", "fp16,fp8",
                      "--kv-cache-memory", "40GiB")
    rows = result["rows"]
    assert len(rows) == 8
    assert rows[0]["cache_ratio"] == 1.0 and rows[1]["cache_ratio"] == 0.5
    assert rows[2]["seats"] >= 8 * rows[0]["seats"]


def test_context_beyond_the_model_limit_warns_and_still_computes(capsys):
    assert main(["plan", "llama-2-7b", "--context", "8192", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["kv_bytes_per_sequence"] == 4 * 2**30
    assert captured.err.count("\n") == 1 and "warning" in captured.err


@pytest.mark.parametrize("argv", [
    ["plan", "lama-3-8b"],
    ["plan", "llama-3-8b", "--context", "0"],
    ["plan", "llama-3-8b", "--batch", "-1"],
    ["plan", "llama-3-8b", "--kv-heads", "5"],
    ["plan", "llama-3-8b", "--gpu", "h1000"],
    ["plan", "llama-3-8b", "--kv-cache-memory", "lots"],
    ["plan", "llama-3-8b", "--kv-cache-dtype", "fp7"],
    ["plan", "--layers", "4", "--heads", "8"],
    ["plan", "llama-3-8b", "--memory-gib", "24"],
])
def test_bad_input_is_one_line_exit_2(argv):
    completed = subprocess.run([sys.executable, "-m", "kvlab", *argv], capture_output=True, text=True)
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.count("\n") == 1 and "error" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_importing_the_planner_imports_neither_torch_nor_numpy():
    code = ("import sys, pkgutil, importlib, kvlab.plan as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('kvlab.plan.' + m.name)\n"
            "import kvlab.commands.plan_cmd\n"
            "bad = [name for name in ('torch', 'numpy', 'transformers', 'gguf') if name in sys.modules]\n"
            "print(','.join(bad))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == ""


def test_planning_a_gguf_file_and_a_name_imports_neither_torch_nor_numpy():
    """Running the command, not just importing it: the header reader and the table renderer too."""
    path = require_file(STORIES, "../shared/models/stories260K.gguf")
    code = ("import contextlib, io, sys\n"
            "from kvlab.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['plan', {str(path)!r}]) == 0 and main(['plan', 'smollm2-135m']) == 0\n"
            "print(','.join(name for name in ('torch', 'numpy', 'transformers', 'gguf') if name in sys.modules))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == ""


@pytest.mark.parametrize("content", ['{"model_type": "llama", "num_hidden_layers": 2', "not json at all", "[]",
                                     '{"model_type": "llama"}', '{"model_type": "llama", "num_hidden_layers": 0, '
                                     '"hidden_size": 64, "num_attention_heads": 4}'])
def test_malformed_config_json_is_one_line_exit_2(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    completed = subprocess.run([sys.executable, "-m", "kvlab", "plan", str(path)], capture_output=True, text=True)
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr
    assert "Traceback" not in completed.stderr


def test_truncated_gguf_is_one_line_exit_2(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)
    completed = subprocess.run([sys.executable, "-m", "kvlab", "plan", str(path)], capture_output=True, text=True)
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr


def test_config_json_directory_plans_like_the_preset(tmp_path, capsys):
    config = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_config = run_json(capsys, str(tmp_path), "--gpu", "h100-sxm")
    from_preset = run_json(capsys, "llama-3-8b", "--gpu", "h100-sxm")
    for key in ("kv_bytes_per_token", "weight_bytes", "seats", "max_context"):
        assert from_config[key] == from_preset[key]


def test_a_closed_pipe_is_not_a_traceback():
    """`kvlab plan ... | head`: the reader is gone before kvlab writes, so its write hits EPIPE every time."""
    child = subprocess.Popen([sys.executable, "-m", "kvlab", "plan", "--list-gpus"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    child.stdout.close()
    stderr = child.stderr.read()
    assert child.wait() == 0
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr


@pytest.mark.parametrize("argv", [["gpt-oss-120b-shape", "--gpu", "rtx-4090"], ["llama-3-8b", "--gpu", "l4",
                                                                              "--context", "131072", "--batch", "4"]])
def test_an_infeasible_batch_prints_what_fits_and_no_decode_floor(capsys, argv, tmp_path):
    """The issue's contradictions: a negative budget beside a decode floor, 0 seats beside tokens/s."""
    if argv[0] == "gpt-oss-120b-shape":
        from test_quantized import GPT_OSS_120B_Q
        (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B_Q))
        argv = [str(tmp_path), *argv[1:]]
    result = run_json(capsys, *argv)
    assert not result["fits"] and result["binding_limit"] == "memory" and result["does_not_fit"]
    assert not {"decode_ms_per_token", "decode_tokens_per_s", "prefill_ms"} & result.keys()
    assert main(["plan", *argv]) == 0
    shown = capsys.readouterr().out
    assert "decode floor" not in shown and "tokens/s" not in shown and "does not fit" in shown
    if result["cache_budget_bytes"] > 0:  # what does fit, in both directions
        assert f"at most {result['seats']:,}" in result["does_not_fit"]
        assert f"{result['max_context']:,} tokens each at batch 4" in result["does_not_fit"]


def test_json_uses_one_name_per_quantity(capsys):
    """The model's stated limit is max_position_embeddings; max_context is always the capacity figure."""
    result = run_json(capsys, "llama-3-8b", "--gpu", "h100-sxm", "--context", "8192", "--batch", "8")
    assert result["model"]["max_position_embeddings"] == 8192 and "max_context" not in result["model"]
    assert result["max_context"] == 53_348 and result["fits"]
