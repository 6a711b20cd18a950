"""`kvlab bench throughput` on stories260K: every request completes with exactly --output-len tokens."""

import json

import pytest

from kvlab.cli import main
from needs import STORIES, require_file


def test_throughput_json_counts_and_baselines(tmp_path, capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", str(STORIES), "--num-prompts", "5", "--input-len", "20", "--output-len", "9",
                 "--kv-cache-memory", "2MB", "--max-num-seqs", "3", "--baselines", "--threads", "1",
                 "--block-size", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    batched = result["batched"]
    assert batched["num_requests"] == 5 and batched["output_tokens"] == 5 * 9  # ignore_eos: exactly 9 each
    assert batched["total_tokens_per_s"] == pytest.approx(batched["output_tokens_per_s"] * (5 * 9 + 5 * 20) / (5 * 9), rel=1e-12)
    assert result["engine_one_at_a_time"]["output_tokens"] == 2 * 9
    # every run prefills its own prompts (20 tokens: a full block each, which the prefix cache
    # would hold): none was served from another run's cached blocks
    assert batched["prefix_cached_tokens"] == result["engine_one_at_a_time"]["prefix_cached_tokens"] == 0
    assert result["block_size"] == 16
    assert result["generate_batch_1"]["output_tokens"] == 9
    assert result["ratio_batched_vs_engine_batch_1"] == pytest.approx(
        batched["output_tokens_per_s"] / result["engine_one_at_a_time"]["output_tokens_per_s"], rel=1e-12)
    assert result["capacity_lines"][1].startswith("CPU KV cache size:")
    assert result["provenance"]["git_commit"] is not None
    if "llama_cpp_batched" in result:  # only where llama-cpp-python is installed
        assert result["llama_cpp_batched"]["output_tokens"] == 5 * 9
    assert "Throughput:" in capsys.readouterr().out


def test_lengths_over_the_model_are_refused(capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    code = main(["bench", "throughput", str(STORIES), "--input-len", "2000", "--output-len", "100",
                 "--kv-cache-memory", "2MB"])
    assert code == 2 and "exceeds the model length" in capsys.readouterr().err
