"""The pool is sized by kvlab.plan: vLLM's start-up lines equal `kvlab plan --engine vllm`, bytes equal the plan."""

import json

import pytest

from engine_helpers import make_engine
from kvlab.cli import main
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from needs import STORIES


@pytest.mark.parametrize("kv_cache_dtype,block_size,memory", [("auto", 16, 2_000_000), ("fp16", 16, 2_000_000),
                                                              ("fp8", 8, 777_777), ("int8", 32, 1_500_000)])
def test_capacity_lines_equal_plan_engine_vllm(stories_model, stories_tokenizer, capsys, kv_cache_dtype,
                                               block_size, memory):
    engine = make_engine(stories_model, stories_tokenizer, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                         kv_cache_memory=memory)
    plan_dtype = "fp32" if kv_cache_dtype == "auto" else kv_cache_dtype  # the model computes in fp32
    assert main(["plan", str(STORIES), "--engine", "vllm", "--vllm-device", "cpu", "--kv-cache-memory", str(memory),
                 "--kv-cache-dtype",
                 plan_dtype, "--block-size", str(block_size), "--context", str(engine.max_model_len), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["vllm"]
    assert engine.capacity_lines == planned["log_lines"]
    assert engine.blocks.num_blocks == planned["num_gpu_blocks"]
    # the pool's tensors hold exactly the plan's bytes for its blocks, and the lines say how many tokens
    spec = stories_model.config.to_plan_spec()
    per_block = kv_bytes_per_sequence(spec, block_size, cache_formats(plan_dtype, model_dtype="fp32"))
    assert engine.pool.nbytes() == planned["num_gpu_blocks"] * per_block == \
        planned["num_gpu_blocks"] * planned["block_bytes_all_layers"]
    assert any(line.startswith(f"CPU KV cache size: {engine.pool.num_tokens:,} tokens") for line in engine.capacity_lines)


@pytest.mark.parametrize("kv_cache_dtype,block_size,memory,seats", [("kivi4", 32, 2_000_000, 3),
                                                                    ("kvquant4", 16, 1_500_000, 5),
                                                                    ("kvquant3", 64, 777_777, 2)])
def test_seat_formats_capacity_lines_equal_plan(stories_model, stories_tokenizer, capsys, tmp_path, kv_cache_dtype,
                                               block_size, memory, seats):
    """The formats only kvlab serves (state per seat: KIVI's residuals, KVQuant's sinks and key outliers) log the
    lines `kvlab plan --engine kvlab` prints for the same pool, seats and --max-model-len, and hold its bytes."""
    from kvquant_helpers import random_calibration
    from kvlab.cache.kvquant_calibration import save_calibration

    path = tmp_path / "cal.safetensors"
    save_calibration(random_calibration(stories_model.config), path)
    engine = make_engine(stories_model, stories_tokenizer, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                         kv_cache_memory=memory, max_num_seqs=seats, kv_calibration=str(path))
    assert main(["plan", str(STORIES), "--kv-cache-memory", str(memory), "--kv-cache-dtype", kv_cache_dtype,
                 "--dtype", "fp32", "--block-size", str(block_size), "--max-num-seqs", str(seats),
                 "--context", str(engine.max_model_len), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["kvlab_engine"]
    assert engine.capacity_lines == planned["log_lines"]
    assert engine.blocks.num_blocks == planned["num_gpu_blocks"]
    assert engine.pool.nbytes() == planned["num_gpu_blocks"] * planned["block_bytes_all_layers"] + \
        planned["residual_bytes"] + planned["fixed_bytes"] <= memory


def test_worked_capacity_for_stories260k(stories_model, stories_tokenizer):
    """By hand: 5 layers x 4 KV heads x 8 channels x (K + V) x 4 B = 1,280 B a token, 20,480 B a block of 16."""
    engine = make_engine(stories_model, stories_tokenizer, kv_cache_memory=1_000_000)
    assert engine.blocks.num_blocks == 1_000_000 // 20_480 == 48
    assert engine.pool.nbytes() == 48 * 20_480
    assert engine.capacity_lines[1].startswith("CPU KV cache size: 768 tokens")


def test_kv_cache_memory_reads_sizes_as_the_flag_does(stories_model, stories_tokenizer):
    """LLM(..., kv_cache_memory="1MiB") sizes the pool as `--kv-cache-memory 1MiB` would; a bad
    size is a one-line KvlabError, not a TypeError from deep in the pool's sizing."""
    from kvlab.engine.engine import EngineConfig, LLMEngine
    from kvlab.errors import KvlabError

    assert EngineConfig(kv_cache_memory="1MiB").kv_cache_memory == 2**20
    by_text = LLMEngine(stories_model, stories_tokenizer, EngineConfig(kv_cache_memory="1MiB"))
    by_int = LLMEngine(stories_model, stories_tokenizer, EngineConfig(kv_cache_memory=2**20))
    assert by_text.capacity == by_int.capacity
    with pytest.raises(KvlabError, match="cannot read"):
        EngineConfig(kv_cache_memory="lots")
