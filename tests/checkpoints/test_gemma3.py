"""Gemma 3 270M from its real GGUF (the lab's third real model): MQA, 5 sliding layers to 1 global.

The architecture is checked against transformers' own reading of the same file (slow test:
transformers dequantises the GGUF into its Gemma3ForCausalLM); the default tests check what
follows from the file: the config, the tokenizer's handling of Gemma's whole-piece
whitespace tokens, packed against dense logits, and a windowed cache's bytes against the plan.
"""

import pytest
import torch

from needs import require_gemma3
from kvlab.cache.window import SinkWindowCache
from kvlab.checkpoints.gguf import config_from_gguf
from kvlab.nn.config import FULL_ATTENTION
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.plan.gguf_file import read_gguf_header
from kvlab.plan.gguf_header import load_gguf_header

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def path():
    return require_gemma3()


@pytest.fixture(scope="module")
def dense(path):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(path, torch.float32, "dense")


def test_config_from_the_header(path):
    config = config_from_gguf(read_gguf_header(path))
    assert (config.n_layers, config.n_heads, config.kv_heads, config.head_size, config.dim) == (18, 4, 1, 256, 640)
    assert [i for i, kind in enumerate(config.layer_types) if kind == FULL_ATTENTION] == [5, 11, 17]
    assert (config.sliding_window, config.rope_base, config.rope_local_base) == (512, 1e6, 1e4)
    assert (config.mlp, config.qk_norm, config.post_norms, config.embed_scale) == ("geglu", True, True, 640 ** 0.5)
    assert config.to_plan_spec().layers == load_gguf_header(path).layers  # the planner reads the same windows


def test_tokenizer_keeps_gemma_whitespace_pieces_whole(dense):
    tokenizer = dense.tokenizer
    # no "▁" prefix (tokenizer.ggml.add_space_prefix is false); runs of spaces and newlines are single pieces
    ids = tokenizer.encode("Hi\n\n  there")
    assert ids[0] == tokenizer.bos_id == 2
    assert [tokenizer.token(i) for i in ids[1:]] == ["Hi", "\n\n", "  ", "there"]
    assert tokenizer.decode(ids) == "Hi\n\n  there"
    assert tokenizer.token(tokenizer.encode("The", add_bos=False)[0]) == "The"


def test_packed_blocks_compute_the_dense_model(path, dense):
    from kvlab.checkpoints.resolve import load_checkpoint
    packed = load_checkpoint(path, torch.float32, "gguf")
    assert packed.model.packing == "gguf"
    ids = torch.tensor([dense.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        a, b = dense.model(ids)[0, -1], packed.model(ids)[0, -1]
    assert int(a.argmax()) == int(b.argmax())
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())  # int16 activations, not a different model


def test_a_long_prompt_through_the_window_cache(dense):
    model = dense.model
    tokens = torch.randint(3, 1000, (1, 560), generator=torch.Generator().manual_seed(0))
    cache = model.reference_cache(1, 560, "fp16")
    assert isinstance(cache, SinkWindowCache)
    with torch.no_grad():
        whole = model(tokens, last_only=True)[0, -1]
        model(tokens[:, :550], cache, last_only=True)
        for i in range(550, 560):
            last = model(tokens[:, i:i + 1], cache)[0, -1]
    # the sliding layers now hold their newest 512 tokens, the global ones all 560
    assert [cache.held_tokens(i) for i in (0, 5)] == [512, 560]
    assert cache.nbytes() == kv_bytes_per_sequence(model.config.to_plan_spec(), 560, cache_formats("fp16")) \
        == 3 * 560 * 1024 + 15 * 512 * 1024
    assert float((whole - last).abs().max()) < 0.05 * float(whole.abs().max())  # fp16 rows against fp32


@pytest.mark.slow
def test_logits_and_tokens_equal_transformers_reading_of_the_file(path, dense):
    """transformers dequantises the same GGUF into Gemma3ForCausalLM (about a minute here)."""
    import os
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = [PROMPT, "Hello world\n\n  two  spaces 12345 naïve 東京 <start_of_turn>user\nhi<end_of_turn>",
             "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
             "must be in want of a wife.\n\n\tHowever little known"]
    for text in texts:
        assert dense.tokenizer.encode(text) == hf_tokenizer(text).input_ids, text
    ids = torch.tensor([dense.tokenizer.encode(texts[2])])
    with torch.no_grad():
        ours, theirs = dense.model(ids), reference(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-4)
