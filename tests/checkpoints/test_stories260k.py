"""stories260K (llama2.c, GGUF): golden greedy text, its tokenizer, and the Q/K permutation."""

import torch

from kvlab.checkpoints.gguf import permute_rope_rows, unpermute_rope_rows
from kvlab.checkpoints.tokenizer import TextStream
from kvlab.nn.generate import generate

GOLDEN = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


def test_greedy_from_bos_is_the_known_story(stories):
    """../shared/README.md: greedy generation from BOS begins with this sentence."""
    ids = generate(stories.model, [stories.tokenizer.bos_id], 40)[0].tolist()
    assert stories.tokenizer.decode(ids).startswith(GOLDEN)


def test_config_read_from_the_header(stories):
    c = stories.model.config
    assert (c.dim, c.n_layers, c.n_heads, c.kv_heads, c.head_size, c.ffn_size, c.vocab_size) == (64, 5, 8, 4, 8, 172, 512)
    assert not c.tie_embeddings and c.rope_base == 10000.0


def test_sentencepiece_tokenizer_round_trips_with_byte_fallback(stories):
    tok = stories.tokenizer
    ids = tok.encode("Once upon a time")
    assert ids[0] == tok.bos_id and [tok.token(i) for i in ids[1:]] == ["▁Once", "▁upon", "▁a", "▁time"]
    text = "Lily said: \"naïve 🙂\"\nThe end."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert any(tok.token(i).startswith("<0x") for i in ids)  # characters outside the 512 pieces


def test_stream_never_splits_a_character_and_keeps_spaces(stories):
    tok = stories.tokenizer
    prompt = tok.encode("She said")
    reply = tok.encode("hi 🙂 there", add_bos=False)  # "▁hi": the word after "said"
    pieces = []
    stream = TextStream(tok, pieces.append, context=prompt[-1:])
    for token_id in reply:
        stream.push(token_id)
    stream.flush()
    assert "".join(pieces) == " hi 🙂 there"
    assert all("\ufffd" not in piece for piece in pieces)


def test_rope_row_permutation_round_trips():
    w = torch.randn(4 * 8, 5)
    torch.testing.assert_close(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)
    assert not torch.equal(permute_rope_rows(w, 4), w)
