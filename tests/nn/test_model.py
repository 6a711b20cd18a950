"""The config-driven decoder: cached decoding equals one full pass; plan bytes equal cache bytes."""

import pytest
import torch

from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.plan.errors import PlanError


def test_cached_decoding_equals_uncached_logits(tiny_config):
    torch.manual_seed(0)
    model = Decoder(tiny_config).eval()
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 12))
    with torch.inference_mode():
        whole = model(tokens)
        cache = model.new_cache(batch=2, max_tokens=16)
        steps = [model(tokens[:, :7], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache.seq_len(0) == 12


def test_last_only_is_the_last_row(tiny_config):
    model = Decoder(tiny_config).eval()
    tokens = torch.randint(0, tiny_config.vocab_size, (1, 5))
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens, last_only=True), model(tokens)[:, -1:])


def test_param_count_matches_modules(tiny_config):
    model = Decoder(tiny_config)
    assert tiny_config.param_count() == sum(p.numel() for p in model.parameters())


def test_plan_spec_bytes_equal_cache_bytes(tiny_config):
    model = Decoder(tiny_config)
    cache = model.new_cache(batch=3, max_tokens=20)
    spec = tiny_config.to_plan_spec()
    assert 3 * kv_bytes_per_sequence(spec, 20, cache_formats("fp32")) == cache.nbytes()


def test_tied_embeddings_share_one_tensor():
    model = Decoder(ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=2, tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight


def test_bad_shapes_are_plan_errors():
    with pytest.raises(PlanError, match="divide"):
        ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=4, n_kv_heads=3)
    with pytest.raises(PlanError, match="MLA"):
        ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=4, attention="mla")
