"""Generation: greedy equals repeated argmax over the full context; streaming, stop tokens, sampling."""

import torch

from kvlab.nn.config import ModelConfig
from kvlab.nn.generate import generate, sample
from kvlab.nn.model import Decoder

CONFIG = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def model() -> Decoder:
    torch.manual_seed(0)
    decoder = Decoder(CONFIG).eval()
    for param in decoder.parameters():
        torch.nn.init.normal_(param, std=0.3)  # peaked logits: greedy ties are impossible
    return decoder


def test_greedy_equals_argmax_over_full_context():
    decoder = model()
    prompt = [3, 1, 4, 1, 5]
    out = generate(decoder, prompt, 10)[0].tolist()
    context = list(prompt)
    with torch.inference_mode():
        for _ in range(10):
            context.append(int(decoder(torch.tensor([context]))[0, -1].argmax()))
    assert out == context[len(prompt):]


def test_streaming_callback_sees_every_token_and_stop_ends_early():
    decoder = model()
    full = generate(decoder, [7], 12)[0].tolist()
    streamed = []
    stop = full[4]
    out = generate(decoder, [7], 12, stop_ids=[stop], on_token=lambda ids: streamed.append(int(ids[0])))[0].tolist()
    assert out == streamed == full[:full.index(stop) + 1]


def test_batch_rows_equal_single_runs():
    decoder = model()
    prompts = torch.tensor([[1, 2, 3], [9, 8, 7]])
    batched = generate(decoder, prompts, 6)
    for row in range(2):
        assert batched[row].tolist() == generate(decoder, prompts[row].tolist(), 6)[0].tolist()


def test_sampling_is_reproducible_with_a_seed_and_greedy_at_zero():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert sample(logits, 0.0).tolist() == [1]
    draws = [sample(logits, 2.0, generator=torch.Generator().manual_seed(s)).item() for s in range(3)]
    again = [sample(logits, 2.0, generator=torch.Generator().manual_seed(s)).item() for s in range(3)]
    assert draws == again
    assert sample(logits, 1.0, top_k=1).tolist() == [1]


def test_zero_new_tokens_is_an_empty_answer():
    decoder = model()
    assert generate(decoder, [1, 2, 3], 0).shape == (1, 0)
    assert generate(decoder, torch.tensor([[1, 2], [3, 4]]), 0).shape == (2, 0)
