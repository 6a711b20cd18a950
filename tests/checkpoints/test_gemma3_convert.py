"""`kvlab convert` and `kvlab export` on Gemma 3 270M (4 query heads, 1 KV head, 5 sliding layers to 1 global).

OUT is transformers' gemma3_text layout (norms stored minus one); kvlab reads it back to the
source's logits, transformers' Gemma3ForCausalLM computes the same logits on it, and its
tokenizer files encode as kvlab does. 1 -> 4 KV heads repeats heads (exact) and mean-pooling
back returns the weights bit for bit; the window cache of the converted model holds the bytes
the plan of its config.json says; model.gguf reads back to the same weights and runs in
llama.cpp (slow); a head count that does not divide 4 is one line, exit 2 (`--to mla`'s
refusal is checked on a tiny Gemma in test_hf_gemma.py). Each OUT is written once per module
(about 1 GB of fp32 weights, in tmp).
"""

import json
import os

import pytest
import torch

from needs import optional_module, require_gemma3, require_module
from kvlab.cli import main

TEXT = "It is a truth universally acknowledged, that a single man\n\n  in possession of a good fortune"


@pytest.fixture(scope="module")
def path():
    return require_gemma3()


@pytest.fixture(scope="module")
def source(path):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(path, torch.float32, "dense")


@pytest.fixture(scope="module")
def ids(source):
    return torch.tensor([source.tokenizer.encode(TEXT)])


@pytest.fixture(scope="module")
def reference(source, ids):
    """The source's logits, computed once."""
    return logits(source.model, ids)


@pytest.fixture(scope="module")
def same(path, tmp_path_factory):
    """The GGUF converted to its own head count (nothing changes)."""
    out = tmp_path_factory.mktemp("gemma") / "same"
    assert main(["convert", path, "-o", str(out), "--dtype", "fp32", "--json"]) == 0  # exact: the GGUF's values
    return out


@pytest.fixture(scope="module")
def mha(same, tmp_path_factory):
    """OUT of `same` (an HF directory as SRC) repeated to 4 KV heads: MHA."""
    out = tmp_path_factory.mktemp("gemma") / "mha"
    assert main(["convert", str(same), "--kv-heads", "4", "-o", str(out), "--json"]) == 0
    return out


def logits(model, ids):
    with torch.no_grad():
        return model(ids)[0]


def load(directory):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(str(directory), torch.float32)


def test_config_is_transformers_gemma3_text(same):
    config = json.loads((same / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 1, 256)
    assert config["sliding_window"] == 512 and config["query_pre_attn_scalar"] == 256
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert config["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert (config["bos_token_id"], config["eos_token_id"]) == (2, 1)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(os.listdir(same))


def test_same_head_count_reproduces_kvlabs_logits(source, same, ids, reference):
    out = load(same).model
    assert out.config == source.model.config
    original, written = source.model.state_dict(), out.state_dict()
    assert all(torch.equal(original[name], written[name]) for name in original)  # norms: m - 1 + 1 == m here
    assert torch.equal(logits(out, ids), reference)


def test_one_to_four_heads_is_exact_and_mean_pooling_back_returns_the_weights(source, mha, ids, reference):
    from kvlab.checkpoints.convert import convert_kv_heads

    model = load(mha).model
    assert (model.config.n_heads, model.config.kv_heads) == (4, 4)
    assert torch.equal(logits(model, ids), reference)  # each query head reads a copy of the head it read
    back, original = convert_kv_heads(model, 1, "mean").state_dict(), source.model.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], original[name]) for name in original)


def test_transformers_gemma3_logits_on_out_equal_kvlabs(mha, ids, reference):
    transformers = require_module("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(mha, local_files_only=True, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.num_key_value_heads == 4
    with torch.no_grad():
        theirs = model.eval()(ids).logits[0]
    torch.testing.assert_close(theirs, reference, rtol=1e-4, atol=2e-4)  # fp32; measured 8e-5 at logits ~32


def test_tokenizer_files_encode_in_transformers_as_in_kvlab(same, source):
    transformers = require_module("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(same, local_files_only=True)
    ours = load(same).tokenizer
    assert (ours.bos_id, ours.eos_id, ours.chat_template) == (2, 1, None)  # the base model's GGUF has no template
    for text in (TEXT, "Hello world\n\n  two  spaces 12345 naïve 東京 <start_of_turn>user\nhi<end_of_turn>"):
        assert ours.encode(text) == source.tokenizer.encode(text)
        assert tokenizer(text).input_ids == ours.encode(text), text  # <bos> first, whitespace pieces whole
        assert tokenizer.decode(ours.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text))


def test_window_cache_bytes_equal_the_plan_of_the_written_config(mha, capsys):
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_bytes_per_token
    from kvlab.plan.loaders import load_model

    model, held = load(mha).model, 520
    planned = load_model(str(mha))
    assert planned.layers == model.config.to_plan_spec().layers  # the planner reads the windows kvlab runs
    cache = model.reference_cache(1, held, "fp16")
    tokens = torch.randint(3, 1000, (1, held), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, cache, last_only=True)
    assert [cache.held_tokens(i) for i in (0, 5)] == [512, 520]
    fp16 = cache_formats("fp16")
    # 4 KV heads x 256 x (K and V) x 2 B = 4 KiB per layer-token: 3 global layers hold 520, 15 sliding 512
    assert cache.nbytes() == kv_bytes_per_sequence(planned, held, fp16) == 3 * 520 * 4096 + 15 * 512 * 4096
    capsys.readouterr()
    assert main(["plan", str(mha), "--kv-cache-dtype", "fp16", "--context", str(held), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kv_bytes_per_token"] == kv_bytes_per_token(model.config.to_plan_spec(), fp16) == 18 * 4096
    assert shown["kv_bytes_per_sequence"] == cache.nbytes()


@pytest.mark.slow
def test_gguf_reads_back_to_the_same_weights_and_runs_in_llama_cpp(path, source, ids, reference, tmp_path):
    """`--gguf` writes a 1 GB F32 gemma3 file beside the safetensors (about 25 s here with llama.cpp's run)."""
    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.plan.gguf_header import load_gguf_header

    same = tmp_path / "same"
    assert main(["convert", path, "-o", str(same), "--gguf"]) == 0
    written = load_checkpoint(str(same / "model.gguf"), torch.float32, "dense").model
    original = source.model.state_dict()
    assert all(torch.equal(written.state_dict()[name], original[name]) for name in original)
    assert load_gguf_header(same / "model.gguf").layers == source.model.config.to_plan_spec().layers
    llama_cpp = optional_module("llama_cpp", "llamacpp")
    import numpy as np

    llm = llama_cpp.Llama(str(same / "model.gguf"), logits_all=True, verbose=False, n_ctx=64)
    llm.eval(ids[0].tolist())
    theirs, ours = np.array(llm.scores[:ids.shape[1]]), reference.numpy()
    assert np.abs(theirs - ours).max() < 0.05 * np.abs(ours).max()  # llama.cpp's f16 KV cache
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.9


def test_export_prints_vllm_serve_and_the_planners_hybrid_prediction(mha, capsys):
    capsys.readouterr()
    assert main(["export", str(mha), "--vllm", "--kv-cache-memory", "1GiB", "--max-model-len", "4096", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["command"].startswith("VLLM_CPU_KVCACHE_SPACE=1 vllm serve ")
    assert "--max-model-len 4096" in exported["command"] and "--served-model-name mha" in exported["command"]
    assert main(["plan", str(mha), "--engine", "vllm", "--vllm-device", "cpu", "--kv-cache-memory", "1GiB",
                 "--context", "4096", "--dtype", "bf16", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert exported["predicted_log_lines"] == planned["vllm"]["log_lines"]
    assert exported["block_size"] == 128


def test_a_head_count_that_does_not_divide_4_is_one_line_exit_2_and_leaves_nothing(path, tmp_path, capsys):
    assert main(["convert", path, "--kv-heads", "3", "-o", str(tmp_path / "out")]) == 2
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert len(lines) == 1 and "must be positive and divide the 4 query heads" in lines[0], lines
    assert os.listdir(tmp_path) == []
