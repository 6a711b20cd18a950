"""`kvlab convert` on stories260K (8 query heads, 4 KV heads): files others load, exact where it must be.

Converting to the current head count changes no weight; repeating to MHA then mean-pooling
back returns the source weights bit for bit; transformers computes kvlab's logits on OUT;
the written config.json plans exactly the cache bytes the converted model allocates; the
GGUF reads back to the same weights and runs in llama.cpp; bad input is one line, exit 2,
and leaves nothing behind.
"""

import json
import os

import pytest
import torch

from needs import STORIES, optional_module, require_file, require_module, require_smollm2
from kvlab.cli import main

IDS = [1, 403, 407, 261, 378, 371, 296, 314, 260, 425]


@pytest.fixture(scope="module")
def stories():
    return str(require_file(STORIES, "../shared/models/stories260K.gguf"))


@pytest.fixture(scope="module")
def source(stories):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(stories).model


@pytest.fixture(scope="module")
def kv2(stories, tmp_path_factory):
    out = tmp_path_factory.mktemp("convert") / "kv2"
    assert main(["convert", stories, "--kv-heads", "2", "--calibration-tokens", "1024", "-o", str(out), "--gguf",
                 "--json"]) == 0  # aligned (the default), on 1,024 tokens of the shared calibration text
    return out


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def load(path):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(str(path)).model


def test_same_head_count_reproduces_the_source_logits(stories, source, tmp_path, capsys):
    out = tmp_path / "same"
    assert main(["convert", stories, "--kv-heads", "4", "-o", str(out)]) == 0
    assert "KV heads 4 -> 4 (unchanged)" in capsys.readouterr().out  # no pooling method named: none ran
    assert torch.equal(logits(load(out)), logits(source))


def test_repeat_to_mha_then_mean_pool_back_returns_the_weights_exactly(stories, source, tmp_path):
    assert main(["convert", stories, "--kv-heads", "8", "-o", str(tmp_path / "mha")]) == 0
    mha = load(tmp_path / "mha")
    assert mha.config.kv_heads == 8
    assert torch.equal(logits(mha), logits(source))  # repetition is exact
    assert main(["convert", str(tmp_path / "mha"), "--kv-heads", "4", "--method", "mean",
                 "-o", str(tmp_path / "back")]) == 0
    back, original = load(tmp_path / "back").state_dict(), source.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], original[name]) for name in original)


def test_output_reports_and_writes_a_full_hf_directory(kv2, capsys):
    files = set(os.listdir(kv2))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "model.gguf"} <= files
    config = json.loads((kv2 / "config.json").read_text())
    assert (config["model_type"], config["num_attention_heads"], config["num_key_value_heads"]) == ("llama", 8, 2)


def test_transformers_logits_and_tokens_on_out_equal_kvlabs(kv2):
    transformers = require_module("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(kv2, local_files_only=True).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0]
    ours = logits(load(kv2))
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    from kvlab.checkpoints.resolve import load_checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(kv2, local_files_only=True)
    text = "Once upon a time, Lily saw a big dog."
    assert tokenizer(text).input_ids == load_checkpoint(str(kv2)).tokenizer.encode(text)  # BOS first, as kvlab


def test_measured_cache_bytes_equal_the_plan_of_the_written_config(kv2):
    from kvlab.nn.generate import generate
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
    from kvlab.plan.loaders import load_model

    model, held = load(kv2), 40
    for dtype in ("fp32", "fp16", "int8"):
        cache = model.new_cache(1, held, dtype)
        generate(model, torch.tensor([IDS]), held - len(IDS) + 1, cache=cache)
        planned = kv_bytes_per_sequence(load_model(str(kv2)), held, cache_formats(dtype, model_dtype="fp32"))
        assert cache.nbytes() == planned, dtype
    assert load_model(str(kv2)).kv_heads == 2


def test_gguf_reads_back_to_the_same_weights_and_runs_in_llama_cpp(kv2):
    from kvlab.plan.gguf_header import load_gguf_header

    hf, gguf = load(kv2).state_dict(), load(kv2 / "model.gguf").state_dict()
    assert all(torch.equal(hf[name], gguf[name]) for name in hf)
    assert load_gguf_header(kv2 / "model.gguf").kv_heads == 2
    llama_cpp = optional_module("llama_cpp", "llamacpp")
    import numpy as np

    llm = llama_cpp.Llama(str(kv2 / "model.gguf"), logits_all=True, verbose=False, n_ctx=64)
    llm.eval(IDS)
    theirs, ours = np.array(llm.scores[:len(IDS)]), logits(load(kv2)).numpy()
    assert np.abs(theirs - ours).max() < 0.05 * np.abs(ours).max()  # llama.cpp's f16 KV cache
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


@pytest.mark.parametrize("flags, match", [
    (["--kv-heads", "3"], "must be positive and divide the 8 query heads"),
    (["--kv-heads", "16"], "must be positive and divide"),
])
def test_bad_head_counts_are_one_line_exit_2_and_leave_nothing(stories, tmp_path, capsys, flags, match):
    assert main(["convert", stories, *flags, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert match in err
    assert os.listdir(tmp_path) == []


def test_corrupt_unknown_and_existing_inputs_are_one_line_errors(stories, tmp_path, capsys):
    corrupt = tmp_path / "bad.gguf"
    corrupt.write_bytes(open(stories, "rb").read()[:5000])
    foreign = tmp_path / "gpt2"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 8, "n_head": 2}))
    (foreign / "model.safetensors").write_bytes(b"")
    existing = tmp_path / "exists"
    existing.mkdir()
    for src, out, match in ((str(corrupt), "o1", "truncated"), (str(foreign), "o2", "Llama-family"),
                            (stories, "exists", "already exists")):
        assert main(["convert", src, "--kv-heads", "2", "-o", str(tmp_path / out)]) == 2
        lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
        assert len(lines) == 1 and match in lines[0], lines
    assert sorted(os.listdir(tmp_path)) == ["bad.gguf", "exists", "gpt2"]
    assert os.listdir(existing) == []


@pytest.mark.slow
def test_smollm2_to_mqa_transformers_agrees(tmp_path):
    smollm2 = require_smollm2()
    transformers = require_module("transformers")
    out = tmp_path / "mqa"
    # fp32 weights: the check is the layout's arithmetic, not bf16's rounding (auto writes SmolLM2's bf16)
    assert main(["convert", str(smollm2), "--kv-heads", "1", "--dtype", "fp32", "-o", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(theirs, logits(load(out)), atol=2e-3, rtol=1e-3)


def test_export_prints_vllm_serve_and_the_plans_capacity_lines(kv2, capsys, tmp_path):
    capsys.readouterr()
    assert main(["export", str(kv2), "--vllm", "--kv-cache-memory", "1GiB", "--max-model-len", "512",
                 "--kv-cache-dtype", "fp8", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["command"].startswith("VLLM_CPU_KVCACHE_SPACE=1 vllm serve ")
    for flag in ("--kv-cache-dtype fp8", "--max-model-len 512", "--served-model-name kv2"):
        assert flag in exported["command"]
    assert main(["plan", str(kv2), "--engine", "vllm", "--vllm-device", "cpu", "--kv-cache-memory", "1GiB",
                 "--context", "512", "--kv-cache-dtype", "fp8", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert exported["predicted_log_lines"] == planned["vllm"]["log_lines"]
    assert exported["block_size"] == 128
    # 5 layers x 2 KV heads x 8 dims x (K and V) x 1 byte (fp8) = 160 B a token, in blocks of 128 tokens
    assert exported["num_blocks"] == 2**30 // (160 * 128)
    assert main(["export", str(tmp_path), "--vllm"]) == 2
