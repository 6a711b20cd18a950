"""GQA/MHA attention to MLA (DeepSeek-V2's latent attention), exact at full rank.

In the spirit of TransMLA (Meng et al., 2025) and MHA2MLA (Ji et al., 2025), with one choice
made for exactness: a Llama-style key rotates every channel, and a rotated key cannot be
absorbed into the query (the rotation depends on the key's position), so whatever keeps its
RoPE is cached as is and only position-free channels go through the latent.

Per layer, with source head dim d, KV heads G and `rope_dim` D (even, 2 <= D <= d):
- RoPE part (MHA2MLA's partial RoPE, its "high-frequency" choice): each KV head keeps the D
  channels of its D/2 highest-frequency RoPE pairs, rotated as before. They become that head's
  decoupled RoPE key, so the cache holds G RoPE keys of D channels (`rope_key_heads = G`; DeepSeek
  shares one). Query head h reads key h // (heads / G), the GQA grouping, so this part is exact.
  The kept pairs are laid out interleaved (DeepSeek's layout) and rotated with base**(D/d), whose
  D/2 frequencies are exactly the source's first D/2.
- Nope part: the other d - D key channels lose their rotation (exact only when D = d; the
  lowest frequencies turn least over a context, so they lose least), and with the values they are
  factorised jointly: M = [W_k_nope; W_v] (G(2d - D) rows) = U S V^T by SVD, truncated to rank R.
  The down-projection W_dkv = V_R^T (orthonormal rows, so the latent is a rotation of x's
  projection, well scaled for an fp16 cache) and the up-projection U_R S_R, repeated for each
  query head of a group. Full rank is min(G(2d - D), hidden): there M = U S V^T exactly.
- The latent is not normalised (`latent_norm=False`): DeepSeek's RMSNorm would change the function.

Cached per token per layer: R + G * D elements (the source caches 2 G d). At full rank and
D = d the conversion reproduces the source (up to float rounding) and caches as much as it
when G d <= hidden; below full rank, or with D < d, it caches less and approximates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.nn.rope import HALF
from kvlab.plan.errors import PlanError


@dataclass(frozen=True)
class MLAConversion:
    """The converted model and what the factorisation kept."""

    model: Decoder
    full_rank: int
    kept_energy: tuple[float, ...]  # per layer: sum of the kept squared singular values over all of them
    exact: bool  # full rank and every channel kept its RoPE: the source's function, up to rounding


def full_rank(config: ModelConfig, rope_dim: int) -> int:
    """The rank at which the joint [K_nope; V] factorisation is exact: min(rows, hidden)."""
    return min(config.kv_heads * (2 * config.head_size - rope_dim), config.dim)


def check_mla_request(config: ModelConfig, rank: int, rope_dim: int) -> None:
    """A one-line PlanError for anything the conversion cannot do, before any work."""
    check_mla_source(config, rope_dim)
    top = full_rank(config, rope_dim)
    if not 1 <= rank <= top:
        raise PlanError(f"--kv-lora-rank {rank} must be between 1 and the full rank {top} "
                        f"(min of {config.kv_heads} KV heads x (2 x {config.head_size} - {rope_dim}) and hidden "
                        f"{config.dim})")


def check_mla_source(config: ModelConfig, rope_dim: int) -> None:
    """What any MLA conversion needs of the source (both layouts), and an even rope_dim within the head."""
    if config.attention != "gqa":
        raise PlanError("--to mla converts grouped-query (MHA/GQA/MQA) attention; this model already uses MLA")
    if config.bias:
        raise PlanError("--to mla converts attention without biases; this model has them")
    if any(config.sliding_windows):
        raise PlanError("--to mla: kvlab's MLA attends fully, and this model (Gemma 3) has sliding-window layers; "
                        "no MLA form of it is written")
    if config.qk_norm:
        raise PlanError("--to mla: a per-head RMSNorm on the keys (q/k norm) cannot be folded into a latent "
                        "projection; this model has one")
    d = config.head_size
    if rope_dim % 2 or not 2 <= rope_dim <= d:
        raise PlanError(f"--rope-dim {rope_dim} must be even and between 2 and the head dim {d}")


def rope_channels(head_dim: int, rope_dim: int, style: str) -> tuple[list[int], list[int]]:
    """(kept, dropped) channel indices of one head: the D/2 highest-frequency pairs, each pair as
    (first, partner), interleaved; then the remaining pairs' channels in the same order."""
    half = head_dim // 2
    pairs = [(i, i + half) if style == HALF else (2 * i, 2 * i + 1) for i in range(half)]
    flat = [channel for pair in pairs for channel in pair]
    return flat[:rope_dim], flat[rope_dim:]


def convert_to_mla(model: Decoder, rank: int, rope_dim: int) -> MLAConversion:
    """A new MLA model; the input model is left untouched. Factorised in float64."""
    config = model.config
    if model.packing != "dense":
        raise PlanError(f"--to mla factorises weights and needs dense ones, not {model.packing}")
    check_mla_request(config, rank, rope_dim)
    d, heads, groups = config.head_size, config.n_heads, config.kv_heads
    kept, dropped = rope_channels(d, rope_dim, config.rope_style)
    nope = d - rope_dim
    new_config = replace(
        config, attention="mla", n_kv_heads=None, head_dim=None, ffn_dim=config.ffn_size, kv_lora_rank=rank, qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope, v_head_dim=d, rope_key_heads=groups, latent_norm=False,
        rope_style="interleaved", rope_base=config.rope_base ** (rope_dim / d),
        name=f"{config.name} [mla rank {rank}, rope {rope_dim} x {groups}]")
    state = {name: t.detach().clone() for name, t in model.state_dict().items() if ".attn." not in name}
    energies = []
    for i, block in enumerate(model.blocks):
        weight = block.attn.qkv.weight.detach().double()
        wq, wk, wv = weight.split((heads * d, groups * d, groups * d))
        hidden = config.dim
        wq, wk, wv = wq.view(heads, d, hidden), wk.view(groups, d, hidden), wv.view(groups, d, hidden)
        # per KV head g: its position-free key rows, then its value rows
        joint = torch.cat((wk[:, dropped], wv), dim=1).reshape(groups * (nope + d), hidden)
        u, s, vh = torch.linalg.svd(joint, full_matrices=False)
        energies.append(float((s[:rank] ** 2).sum() / (s ** 2).sum()))
        up = (u[:, :rank] * s[:rank]).view(groups, nope + d, rank)  # per KV head: [k_nope rows; v rows]
        per_query = up.repeat_interleave(heads // groups, dim=0)  # query head h reads group h // (heads/groups)
        p = f"blocks.{i}.attn."
        dtype = block.attn.qkv.weight.dtype
        state[p + "wq.weight"] = torch.cat((wq[:, dropped], wq[:, kept]), dim=1).reshape(heads * d, hidden).to(dtype)
        state[p + "wkv_a.weight"] = torch.cat((vh[:rank], wk[:, kept].reshape(groups * rope_dim, hidden))).to(dtype)
        state[p + "wkv_b.weight"] = per_query.reshape(heads * (nope + d), rank).to(dtype)
        state[p + "o.weight"] = block.attn.o.weight.detach().clone()
    converted = Decoder.from_state_dict(new_config, state).to(model.dtype)
    top = full_rank(config, rope_dim)
    return MLAConversion(converted.train(model.training), top, tuple(energies), rank == top and rope_dim == d)
