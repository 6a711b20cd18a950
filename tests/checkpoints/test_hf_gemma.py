"""Gemma 3's Hugging Face layout on a tiny random model: no wheel needed, seconds to run.

kvlab -> gemma3_text directory -> kvlab is the identity (norms minus one and back); transformers'
Gemma3ForCausalLM computes kvlab's logits on it (sliding windows shorter than the prompt, two
RoPE bases, q/k norms, post-norms); configs kvlab cannot compute are refused in one line, and
so are Gemma models llama.cpp's gemma3 graph would compute differently.
"""

import json

import pytest
import torch

from needs import require_module
from kvlab.checkpoints.convert import convert_kv_heads
from kvlab.cli import main
from kvlab.checkpoints.hf import load_hf, save_hf
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

SLIDING, FULL = "sliding_attention", "full_attention"


def tiny(layer_types=(SLIDING,) * 5 + (FULL, SLIDING), kv_heads=1, **overrides) -> Decoder:
    fields = dict(vocab_size=97, dim=32, n_layers=len(layer_types), n_heads=4, n_kv_heads=kv_heads, head_dim=16,
                  ffn_dim=48, mlp="geglu", norm_eps=1e-6, rope_base=1e6, max_seq_len=64, tie_embeddings=True,
                  qk_norm=True, post_norms=True, embed_scale=32 ** 0.5, sliding_window=5, layer_types=layer_types,
                  rope_local_base=1e4, name="tiny")
    config = ModelConfig(**fields | overrides)
    torch.manual_seed(0)
    model = Decoder(config).eval()
    with torch.no_grad():  # norm multipliers away from 1, so a missed "minus one" shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand_like(param) * 1.5)
    return model


IDS = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))


def test_round_trip_is_the_identity_and_transformers_computes_the_same_logits(tmp_path):
    model = tiny(kv_heads=2)
    save_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["layer_types"][5], config["sliding_window"]) == ("gemma3_text", FULL, 5)
    back, _ = load_hf(tmp_path)
    assert back.config == model.config
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    transformers = require_module("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(theirs).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(theirs(IDS).logits, model(IDS), rtol=0, atol=1e-5)


def test_kv_head_conversion_keeps_the_shared_q_and_k_norms(tmp_path):
    model = tiny()
    for heads in (1, 2, 4):
        converted = convert_kv_heads(model, heads)
        assert torch.equal(converted.blocks[0].attn.k_norm.weight, model.blocks[0].attn.k_norm.weight)
        with torch.no_grad():
            torch.testing.assert_close(converted(IDS), model(IDS), rtol=0, atol=1e-6)
    back = convert_kv_heads(convert_kv_heads(model, 4), 1).state_dict()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("change, match", [
    ({"final_logit_softcapping": 30.0}, "softcap"),
    ({"hidden_activation": "gelu"}, "GeGLU"),
    ({"use_bidirectional_attention": True}, "causal"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                          "sliding_attention": {"rope_type": "default"}}}, "RoPE scaling"),
])
def test_configs_kvlab_cannot_compute_are_refused(tmp_path, change, match):
    save_hf(tiny(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(PlanError, match=match):
        load_hf(tmp_path)


def test_legacy_rope_keys_alone_read_as_transformers_4_reads_them(tmp_path):
    model = tiny(rope_local_base=5e3)
    save_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_hf(tmp_path)[0].config == model.config


def test_gguf_writes_gemma3_and_refuses_what_llama_cpp_would_compute_differently(tmp_path):
    from kvlab.checkpoints.gguf import load_gguf
    from kvlab.checkpoints.gguf_write import write_gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(93)]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 97,
                "tokenizer.ggml.token_type": [3, 3, 3, 2] + [1] * 93, "tokenizer.ggml.bos_token_id": 2}
    model = tiny()
    write_gguf(model, str(tmp_path / "m.gguf"), metadata)
    back = load_gguf(str(tmp_path / "m.gguf"))[0]
    assert back.config.layer_types == model.config.layer_types and back.config.rope_local_base == 1e4
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    for other, match in ((tiny(layer_types=(SLIDING, FULL) * 3), "every 6th layer"),
                         (tiny(rope_local_base=5e3), "base 10000"), (tiny(query_scale=0.5), "head_dim")):
        with pytest.raises(PlanError, match=match):
            write_gguf(other, str(tmp_path / "x.gguf"), metadata)


@pytest.mark.parametrize("flags, match", [
    (["--to", "mla", "--kv-lora-rank", "8"], "kvlab's MLA attends fully"),
    (["--kv-heads", "3"], "must be positive and divide the 4 query heads"),
])
def test_convert_refusals_are_one_line_exit_2_and_leave_nothing(tmp_path, capsys, flags, match):
    source = tmp_path / "src"
    save_hf(tiny(), source)
    assert main(["convert", str(source), *flags, "-o", str(tmp_path / "out")]) == 2
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert len(lines) == 1 and match in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
