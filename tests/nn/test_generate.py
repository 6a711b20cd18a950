"""Generation: greedy equals repeated argmax over the full context; streaming, stop tokens, sampling."""

import pytest
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


def test_the_lab_rows_generate_what_a_reference_cache_does():
    """Module by module (this model is not on GGUF blocks): the pool's rows against the lab's own cache."""
    from kvlab.cache.pooled_rows import PooledRows

    decoder = model()
    prompts = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    stats: dict = {}
    rows = PooledRows.for_model(CONFIG, 2, 16, block_size=4)  # several blocks per row
    pooled = generate(decoder, prompts, 12, cache=rows, stats=stats)
    assert torch.equal(pooled, generate(decoder, prompts, 12, cache=decoder.reference_cache(2, 16)))
    assert stats["paged_step"] is False


def test_rows_too_long_for_their_capacity_are_refused():
    with pytest.raises(ValueError, match="over their capacity of 15"):
        generate(model(), torch.tensor([[3, 1, 4, 1, 5]] * 2), 12, cache=model().new_cache(2, 15))


def test_every_pool_format_generates_and_the_c_step_takes_what_it_reads():
    """The lab's cache is the engine's pool in every format; the paged C step reads the ones it has
    kernels for (per-token formats and KIVI's blocks and residual), and generates what the module path does."""
    from kvlab.cache.pooled_rows import PooledRows
    from kvlab.nn.generate import cache_for_generation

    from needs import require_kernels
    from test_c_model import GQA, ggml_model

    require_kernels()
    decoder = ggml_model(GQA)
    prompt = [3, 1, 4, 1, 5]
    for dtype, in_c in (("int8", True), ("fp8", True), ("fp16", True), ("int4", True), ("int2", True),
                        ("kivi4", True), ("kivi2", True)):
        cache = cache_for_generation(decoder, 1, len(prompt) + 11, dtype)
        assert isinstance(cache, PooledRows)
        stats: dict = {}
        out = generate(decoder, prompt, 12, cache=cache, stats=stats)
        assert stats["paged_step"] is in_c, dtype
        unfused = generate(decoder, prompt, 12, cache=cache_for_generation(decoder, 1, len(prompt) + 11, dtype),
                           paged_step=False)
        assert torch.equal(out, unfused), dtype
