"""Gemma 3's layer kinds on a tiny random model: sliding windows, q/k norms, post-norms, GeGLU.

The reference for a sliding layer is attention written out by hand (softmax over the keys
t - W < p <= t); the window cache (kvlab.cache.window), which drops what a sliding layer no
longer sees, must give the logits of a forward pass over the whole sequence, token by token
and in chunks, and hold exactly the bytes kvlab.plan counts for the model.
"""

import math

import pytest
import torch

from kvlab.cache.base import CacheError
from kvlab.cache.window import SinkWindowCache
from kvlab.nn.attention import Attention
from kvlab.nn.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvlab.nn.model import Decoder
from kvlab.nn.rope import RoPE
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.plan.errors import PlanError

WINDOW = 6
TYPES = (SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)


def gemma_like(**changes) -> ModelConfig:
    fields = dict(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=16, ffn_dim=48, mlp="geglu",
                  norm_eps=1e-6, rope_base=1e6, rope_local_base=1e4, max_seq_len=64, tie_embeddings=True,
                  qk_norm=True, post_norms=True, embed_scale=32 ** 0.5, query_scale=20 ** -0.5,
                  sliding_window=WINDOW, layer_types=TYPES, name="tiny-gemma")
    return ModelConfig(**{**fields, **changes})


def tiny_model(**changes) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(gemma_like(**changes)).eval()
    with torch.no_grad():  # norms away from 1, so a norm applied twice or not at all shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def test_sliding_attention_matches_a_written_out_window():
    config = gemma_like()
    torch.manual_seed(1)
    attn = Attention(config, layer=0).eval()
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    rope = RoPE(config.head_size, config.max_seq_len, config.rope_local_base)
    x = torch.randn(1, 20, config.dim)
    with torch.no_grad():
        out = attn(x, rope)
        heads = attn.qkv(x).view(1, 20, 6, 16).transpose(1, 2)
        q, k, v = heads[:, :4], heads[:, 4:5], heads[:, 5:]
        q, k = rope(attn.q_norm(q)), rope(attn.k_norm(k))
        scores = q @ k.transpose(-1, -2) * config.query_scale  # one KV head serves all four
        t, p = torch.arange(20)[:, None], torch.arange(20)[None, :]
        scores = scores.masked_fill(~((p <= t) & (p > t - WINDOW)), -math.inf)
        expected = attn.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 20, 64))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    full = Attention(gemma_like(layer_types=(FULL_ATTENTION,) * 3), layer=0).eval()
    full.load_state_dict(attn.state_dict())
    with torch.no_grad():
        assert not torch.allclose(full(x, rope)[:, WINDOW:], out[:, WINDOW:], atol=1e-3)  # the window matters
        torch.testing.assert_close(full(x, rope)[:, :WINDOW], out[:, :WINDOW])  # and only past it


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_window_cache_gives_the_whole_sequence_logits(chunk):
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 4 * WINDOW + 3), generator=torch.Generator().manual_seed(2))
    cache = model.reference_cache(1, tokens.shape[1])
    assert isinstance(cache, SinkWindowCache)
    with torch.no_grad():
        whole = model(tokens)
        pieces = [model(tokens[:, at:at + chunk], cache) for at in range(0, tokens.shape[1], chunk)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-4, atol=1e-5)
    assert [cache.held_tokens(layer) for layer in range(3)] == [WINDOW, WINDOW, tokens.shape[1]]


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_a_pool_that_keeps_everything_masks_the_same_window(chunk):
    """The lab's rows on the pool (one block per row: nothing handed back) mask each sliding group's window."""
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(3))
    kept = model.new_cache(1, tokens.shape[1])
    assert not isinstance(kept, SinkWindowCache) and [g.window for g in kept.pool.groups] == [WINDOW, WINDOW, None]
    with torch.no_grad():
        whole = model(tokens)
        stepped = torch.cat([model(tokens[:, i:i + chunk], kept) for i in range(0, tokens.shape[1], chunk)], dim=1)
    torch.testing.assert_close(stepped, whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("tokens", [WINDOW - 2, WINDOW, 3 * WINDOW + 1])
def test_window_cache_bytes_equal_the_plan(dtype, tokens):
    model = tiny_model()
    cache = model.reference_cache(1, 64, dtype)
    with torch.no_grad():
        model(torch.zeros(1, tokens, dtype=torch.long), cache)
    formats = cache_formats(dtype, model_dtype="fp32")
    assert cache.nbytes() == kv_bytes_per_sequence(model.config.to_plan_spec(), tokens, formats)


def test_sliding_layers_use_the_local_rope_table():
    model = tiny_model()
    assert model.rope_for(0) is model.rope_local and model.rope_for(2) is model.rope
    assert (model.rope_local.base, model.rope.base) == (1e4, 1e6)


def test_a_pre_rope_cache_rotates_each_layer_with_its_own_table():
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 2 * WINDOW + 3), generator=torch.Generator().manual_seed(5))

    def stepped(cache):
        model(tokens[:, :5], cache)
        return torch.stack([model(tokens[:, i:i + 1], cache)[0, -1] for i in range(5, tokens.shape[1])])

    with torch.no_grad():
        whole = model(tokens)[0, 5:]
        cache = model.new_cache(1, 64, "fp32", pre_rope=True)  # keys stored raw, rotated on read
        assert cache.pre_rope and not isinstance(cache, SinkWindowCache)
        assert torch.allclose(stepped(cache), whole, atol=1e-5)
        one_table = model.new_cache(1, 64, "fp32", pre_rope=True)
        one_table.rope = model.rope.at  # every layer with the global table: the sliding layers' keys go wrong
        assert not torch.allclose(stepped(one_table), whole, atol=1e-3)
    with pytest.raises(CacheError, match="one rope function per layer"):
        from kvlab.cache.factory import make_cache
        make_cache("fp32", 3, 1, 1, 16, 16, 8, pre_rope=True, rope=model.layer_ropes()[:2])


def test_each_gemma_extra_changes_the_logits():
    tokens = torch.randint(0, 97, (1, 2 * WINDOW), generator=torch.Generator().manual_seed(4))
    base = tiny_model()
    with torch.no_grad():
        reference = base(tokens)
        for change in (dict(qk_norm=False), dict(post_norms=False), dict(embed_scale=1.0), dict(query_scale=None),
                       dict(mlp="swiglu"), dict(rope_local_base=None)):
            other = tiny_model(**change)
            state = {k: v for k, v in base.state_dict().items() if k in other.state_dict()}
            other.load_state_dict(state, strict=False)
            assert not torch.allclose(other(tokens), reference, atol=1e-4), change


def test_parameter_count_and_config_round_trip():
    model = tiny_model()
    assert model.config.param_count() == sum(p.numel() for p in model.parameters())
    again = ModelConfig(**model.config.to_dict())
    assert again == model.config and isinstance(again.layer_types, tuple)
    with pytest.raises(PlanError, match="layer_types"):
        gemma_like(layer_types=(SLIDING_ATTENTION,) * 2)
    with pytest.raises(PlanError, match="sliding_window"):
        gemma_like(sliding_window=0)
