"""GQA/MHA -> MLA (kvlab.checkpoints.mla) on tiny random Llama models, in fp32.

At full rank with every channel keeping its RoPE the converted model computes the source's
logits; below full rank the SVD keeps the stated energy and the cache is the planned size;
cached decode (naive and absorbed) equals prefill; the written DeepSeek-V2 directory loads
back to the same model and the planner counts its parameters and bytes.
"""

import pytest
import torch

from kvlab.checkpoints.mla import convert_to_mla, full_rank, rope_channels
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError


def tiny(kv_heads: int, style: str = "half", head_dim: int = 8, tied: bool = False, seed: int = 0,
         rope_base: float = 300.0) -> Decoder:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, head_dim=head_dim,
                         rope_style=style, rope_base=rope_base, max_seq_len=64, tie_embeddings=tied)
    model = Decoder(config).eval()
    for param in model.parameters():  # larger than GPT-2's init, so attention is far from uniform
        torch.nn.init.normal_(param, std=0.3)
    return model


TOKENS = torch.randint(0, 48, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("kv_heads, style, head_dim, tied", [
    (4, "half", 8, False), (2, "half", 8, True), (1, "half", 8, False),  # MHA, GQA, MQA
    (2, "interleaved", 8, False), (4, "half", 16, False),  # G*d = 64 > hidden 32: full rank is the hidden size
])
def test_full_rank_reproduces_the_source_logits(kv_heads, style, head_dim, tied):
    source = tiny(kv_heads, style, head_dim, tied)
    top = full_rank(source.config, head_dim)
    assert top == min(kv_heads * head_dim, 32)  # every key channel keeps RoPE: the latent holds V only
    conversion = convert_to_mla(source, top, head_dim)
    assert conversion.exact and conversion.kept_energy == pytest.approx((1.0, 1.0), abs=1e-12)
    ours, theirs = logits(conversion.model), logits(source)
    assert theirs.abs().max() > 1.0  # not trivially small
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    config = conversion.model.config
    assert (config.attention, config.rope_key_heads, config.latent_norm) == ("mla", kv_heads, False)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (0, head_dim, head_dim)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_partial_rope_at_full_rank_only_drops_the_slow_rotations(style):
    """With base 1e12 and d = 8 the two dropped pairs turn 1e-6 and 1e-9 rad per token: partial
    RoPE at full rank is then the source up to that (a wrong row layout is off by whole units)."""
    source = tiny(2, style, rope_base=1e12)
    conversion = convert_to_mla(source, full_rank(source.config, 4), 4)
    assert conversion.model.config.qk_nope_head_dim == 4 and not conversion.exact
    torch.testing.assert_close(logits(conversion.model), logits(source), rtol=0, atol=1e-4)
    far = convert_to_mla(tiny(2, style), full_rank(source.config, 4), 4).model  # base 300: they do turn
    assert (logits(far) - logits(tiny(2, style))).abs().max() > 1e-2


def test_the_source_is_untouched_and_bad_requests_are_plan_errors():
    source = tiny(2)
    before = {name: t.clone() for name, t in source.state_dict().items()}
    convert_to_mla(source, 10, 4)
    assert all(torch.equal(before[name], t) for name, t in source.state_dict().items())
    for rank, rope in ((0, 8), (33, 8), (25, 6), (8, 3), (8, 0), (8, 10)):
        with pytest.raises(PlanError):
            convert_to_mla(source, rank, rope)
    mla = convert_to_mla(source, 8, 4).model
    with pytest.raises(PlanError, match="already uses MLA"):
        convert_to_mla(mla, 8, 4)


def test_rope_channels_keep_the_highest_frequency_pairs():
    assert rope_channels(8, 4, "half") == ([0, 4, 1, 5], [2, 6, 3, 7])
    assert rope_channels(8, 4, "interleaved") == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert rope_channels(8, 8, "half")[1] == []


def test_reduced_rank_keeps_the_svd_energy_and_the_joint_factorisation():
    """At rank R the up- times down-projection is the best rank-R approximation of [K_nope; V]:
    its squared error is exactly the dropped squared singular values."""
    source = tiny(2)
    d, rope, rank = 8, 4, 6
    conversion = convert_to_mla(source, rank, rope)
    energies = [convert_to_mla(source, r, rope).kept_energy[0] for r in (2, 4, 6, 12, 24)]
    assert energies == sorted(energies) and energies[-1] == pytest.approx(1.0) and energies[0] < 0.9
    assert conversion.kept_energy[0] == energies[2] and not conversion.exact
    q, kv = 4 * d, 2 * d
    wk, wv = source.blocks[0].attn.qkv.weight.detach().double().split((q, kv, kv))[1:]
    dropped = rope_channels(d, rope, "half")[1]
    joint = torch.cat((wk.view(2, d, 32)[:, dropped], wv.view(2, d, 32)), dim=1).reshape(-1, 32)
    attn = conversion.model.blocks[0].attn
    down = attn.wkv_a.weight.detach().double()[:rank]
    up = attn.wkv_b.weight.detach().double().view(4, (d - rope) + d, rank)[::2]  # one query head per group
    approx = up.reshape(-1, rank) @ down
    s = torch.linalg.svdvals(joint)
    assert ((joint - approx) ** 2).sum().item() == pytest.approx((s[rank:] ** 2).sum().item(), rel=1e-9)


@pytest.mark.parametrize("absorb", [False, True])
def test_cached_decode_through_mla_equals_prefill(absorb):
    """Reduced rank, partial RoPE (nope > 0), two RoPE keys: prompt then one token at a time,
    naive and absorbed, equal to one uncached forward pass."""
    model = convert_to_mla(tiny(2), 9, 4).model
    for block in model.blocks:
        block.attn.absorb = absorb
    full = logits(model)
    cache = model.new_cache(2, 32, "fp32")
    with torch.no_grad():
        steps = [model(TOKENS[:, :10], cache=cache)] + [model(TOKENS[:, i:i + 1], cache=cache) for i in range(10, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=2e-5)


def test_written_deepseek_directory_round_trips_and_is_planned(tmp_path):
    from kvlab.checkpoints.hf import load_hf, save_hf
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_bytes_per_token
    from kvlab.plan.loaders import load_model

    model = convert_to_mla(tiny(2), 9, 4).model
    save_hf(model, str(tmp_path))
    back, _ = load_hf(str(tmp_path))
    assert back.config == model.config
    assert torch.equal(logits(back), logits(model))
    spec = load_model(str(tmp_path))
    assert spec.params_total == sum(p.numel() for p in back.parameters()) == model.config.param_count()
    # per token per layer: latent 9 + 2 RoPE keys of 4, fp16: (9 + 8) * 2 B * 2 layers
    assert kv_bytes_per_token(spec, cache_formats("fp16")) == (9 + 2 * 4) * 2 * 2
    for dtype in ("fp32", "fp16", "bf16", "fp8_e4m3"):
        cache = back.new_cache(1, 20, dtype)
        with torch.no_grad():
            back(TOKENS[:1, :13], cache=cache)
        assert cache.nbytes() == kv_bytes_per_sequence(spec, 20, cache_formats(dtype, model_dtype="fp32")), dtype
