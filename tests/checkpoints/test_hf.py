"""Hugging Face directories: save then load returns the same tensors, tokenizer and logits."""

import pytest

from needs import require_module
import torch

from kvlab.checkpoints.hf import load_hf, save_hf
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError


def test_llama_round_trip_with_tokenizer(stories, tmp_path):
    save_hf(stories.model, str(tmp_path), stories.tokenizer)
    model, tokenizer = load_hf(str(tmp_path))
    original = stories.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert tokenizer.encode("Once upon a time") == stories.tokenizer.encode("Once upon a time")
    tokens = torch.tensor([tokenizer.encode("Lily saw a cat")])
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens), stories.model(tokens))


def test_transformers_reads_our_directory(stories, tmp_path):
    transformers = require_module("transformers")
    save_hf(stories.model, str(tmp_path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.tensor([stories.tokenizer.encode("Lily saw a cat")])
    with torch.inference_mode():
        torch.testing.assert_close(theirs(tokens).logits, stories.model(tokens), rtol=1e-4, atol=1e-4)


def test_non_llama_configs_round_trip_under_kvlab_names(tmp_path):
    config = ModelConfig(vocab_size=65, dim=32, n_layers=2, n_heads=4, mlp="gelu", norm="layernorm", bias=True,
                         rope_style="interleaved", tie_embeddings=True, max_seq_len=32, name="char")
    model = Decoder(config).to(torch.bfloat16)
    save_hf(model, str(tmp_path))
    loaded, tokenizer = load_hf(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.config == config and tokenizer is None
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_missing_directory_parts_are_plan_errors(tmp_path):
    with pytest.raises(PlanError, match="config.json is missing"):
        load_hf(str(tmp_path))
