"""GQA/MHA attention to DeepSeek-V2's MLA, fitted on calibration activations (`--layout deepseek`).

DeepSeek-V2's layout caches, per token and layer, a latent c of `kv_lora_rank` channels and ONE
RoPE key of `qk_rope_head_dim` channels shared by every head. kvlab's exact conversion
(kvlab.checkpoints.mla, `--layout kvlab`) keeps one RoPE key per source KV head, which no
other server implements; this one writes the real layout and recovers the model's function
as far as its size allows, before any training:

1. One shared RoPE key (TransMLA's RoRoPE, in complex form, kvlab.checkpoints.rope_pairs): at
   each frequency the G KV heads' key pairs form a complex G-vector; a unitary mix of them
   commutes with RoPE, so its top principal component (each head weighted by the energy of the
   queries that read it) becomes the shared RoPE key's pair at that frequency, and each query
   head reads it through a complex coefficient (a 2x2 rotation and scale of its query pair).
   What the component does not explain, per head, is the head's residual key: it is exact
   that score = (query . RoPE part) + (query . residual), so the only change is that the
   residual loses its rotation. With a RoPE key narrower than the head (D < d), only every
   s-th frequency from the highest can keep RoPE (DeepSeek's key rotates at rope_theta'^(-2i/D));
   s is chosen by the kept components' contribution on the calibration text (MHA2MLA keeps the
   dimensions with the largest contribution), and rope_theta' = theta^(s D / d).
2. Joint K/V factorisation on activations (MHA2MLA's joint SVD; CARE's covariance weighting):
   the residual keys and the values of all G heads (2 G d rows) are compressed to the latent by
   PCA of their calibration outputs, each key weighted by its readers' query covariance (score
   error = query x key error) and each value by the output projection of its readers (what
   reaches the residual stream). The latent's channels are scaled to unit RMS on the text
   (well within an fp8 cache's range); the up-projections are the per-head inverse maps.
3. The output projection is refitted layer by layer on what the converted layers before it
   produce (kvlab.checkpoints.layerwise).

The queries keep the source's channels (qk_nope_head_dim = v_head_dim = head dim) and absorb
the change of score scale (1/sqrt(d) -> 1/sqrt(d + D)). The latent is not normalised in the
model built here (`latent_norm=False`); DeepSeek's RMSNorm is folded exactly when the
directory is written (kvlab.checkpoints.hf_deepseek), and `norm_eps` becomes DeepSeek's 1e-6,
the epsilon transformers' latent norm always uses, so every implementation computes one function.
Ranks are one per model: DeepSeek-V2's config has one kv_lora_rank, and vLLM allocates every
layer's latent at that width, so a per-layer rank would buy no cache in either server.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from kvlab.checkpoints.rope_pairs import pair_energy, psd_power, to_complex, to_real
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.nn.rope import INTERLEAVED
from kvlab.plan.errors import PlanError

DEEPSEEK_EPS = 1e-6  # transformers' DeepseekV2 normalises the latent with this epsilon whatever the config says


@dataclass(frozen=True)
class AwareMLA:
    """The converted model and what the fit kept."""

    model: Decoder
    rope_stride: int  # RoPE keeps every rope_stride-th source frequency, from the highest
    kept_energy: tuple[float, ...]  # per layer: weighted K/V energy the latent keeps (0..1)
    rope_energy: tuple[float, ...]  # per layer: weighted key energy the shared RoPE key holds
    layers: list[dict]


def budget(config: ModelConfig, fraction: float, rope_dim: Optional[int] = None) -> tuple[int, int]:
    """(kv_lora_rank, rope_dim) whose cache is `fraction` of the source's 2 G d elements per token and
    layer. Without `rope_dim`: the head dim when the latent keeps at least as many channels, else half."""
    d = config.head_size
    total = round(fraction * 2 * config.kv_heads * d)
    if not 0 < fraction <= 1:
        raise PlanError(f"--kv-cache-fraction {fraction} must be in (0, 1]")
    if rope_dim is None:
        rope_dim = d if total - d >= d else d // 2
    if total - rope_dim < 1:
        raise PlanError(f"--kv-cache-fraction {fraction} leaves {total} cached channels per token and layer, "
                        f"no room for a latent beside a {rope_dim}-channel RoPE key")
    return total - rope_dim, rope_dim


def check_request(config: ModelConfig, rank: int, rope_dim: int) -> None:
    """One-line PlanErrors for what this conversion cannot do, before any work."""
    from kvlab.checkpoints.mla import check_mla_source

    check_mla_source(config, rope_dim)
    top = 2 * config.kv_heads * config.head_size
    if not 1 <= rank <= min(top, config.dim):
        raise PlanError(f"--kv-lora-rank {rank} must be between 1 and {min(top, config.dim)} "
                        f"(the {config.kv_heads} KV heads' keys and values, {top} channels, or the hidden size)")


def strides(head_dim: int, rope_dim: int) -> list[int]:
    """Every s for which frequencies 0, s, 2s, ... (rope_dim / 2 of them) exist in a head of head_dim."""
    pairs, kept = head_dim // 2, rope_dim // 2
    return [1] if kept in (1, pairs) else [s for s in range(1, pairs) if s * (kept - 1) <= pairs - 1]


def convert_to_mla_aware(model: Decoder, rank: int, rope_dim: int, calibration: torch.Tensor,
                         progress: Optional[Callable[[int], None]] = None,
                         residual_span: Optional[int] = None) -> AwareMLA:
    """A new DeepSeek-layout MLA model; the input model is left untouched. Fitted in float64."""
    from kvlab.checkpoints.layerwise import convert_layerwise

    config = model.config
    if model.packing != "dense":
        raise PlanError(f"--to mla factorises weights and needs dense ones, not {model.packing}")
    check_request(config, rank, rope_dim)
    d = config.head_size
    stride = _choose_stride(model, rope_dim, calibration[: max(1, min(4, len(calibration)))])
    new_config = replace(
        config, attention="mla", n_kv_heads=None, head_dim=None, ffn_dim=config.ffn_size, kv_lora_rank=rank,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=d, v_head_dim=d, rope_key_heads=1, latent_norm=False,
        rope_style=INTERLEAVED, rope_base=config.rope_base ** (stride * rope_dim / d), norm_eps=DEEPSEEK_EPS,
        query_scale=None, name=f"{config.name} [mla rank {rank}, rope {rope_dim}, deepseek]")
    kept, rope_kept = [], []

    def fit(layer: int, attention, sigma: torch.Tensor):
        state, facts = fit_layer(attention, sigma, config, rank, rope_dim, stride, residual_span)
        kept.append(facts["latent_energy_kept"])
        rope_kept.append(facts["rope_energy"])
        return state, facts

    result = convert_layerwise(model, new_config, calibration, fit, progress=progress)
    return AwareMLA(result.model, stride, tuple(kept), tuple(rope_kept), result.layers)


def _split(attention, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """wq [H, d, in], wk and wv [G, d, in], wo [out, H, d] of a GQA attention module, float64."""
    heads, groups, d, dim = config.n_heads, config.kv_heads, config.head_size, config.dim
    weight = attention.qkv.weight.detach().double()
    wq, wk, wv = weight.split((heads * d, groups * d, groups * d))
    wo = attention.o.weight.detach().double().view(-1, heads, d)
    return wq.view(heads, d, dim), wk.view(groups, d, dim), wv.view(groups, d, dim), wo


def _rope_components(wq: torch.Tensor, wk: torch.Tensor, sigma: torch.Tensor, style: str):
    """Per frequency, the query-weighted principal components of the heads' key pairs:
    (complex key rows [G, d/2, in], per-head weights [G, d/2], eigenvalues [d/2, G] and
    eigenvectors [d/2, G, G], both largest first)."""
    heads, groups = wq.shape[0], wk.shape[0]
    rep = heads // groups
    qc, kc = to_complex(wq, style), to_complex(wk, style)
    reading = pair_energy(qc, sigma).view(groups, rep, -1).sum(1)  # [G, d/2]
    weight = reading.clamp_min(torch.finfo(reading.dtype).tiny).sqrt()
    z = kc * weight[..., None]
    cov = torch.einsum("gfa,ab,hfb->fgh", z, sigma.to(z.dtype), z.conj())
    values, vectors = torch.linalg.eigh(cov)
    return kc, weight, values.flip(-1), vectors.flip(-1)


@torch.no_grad()
def _choose_stride(model: Decoder, rope_dim: int, windows: torch.Tensor) -> int:
    """The stride whose kept frequencies hold the most query-weighted key energy, summed over layers
    (each layer's share of its own total), on a few calibration windows of the source."""
    config = model.config
    options = strides(config.head_size, rope_dim)
    if len(options) == 1:
        return options[0]
    sigmas: list[torch.Tensor] = []
    hooks = [block.attn.register_forward_pre_hook(
        lambda module, args: sigmas.append(_second_moment(args[0]))) for block in model.blocks]
    try:
        model(windows)
    finally:
        for hook in hooks:
            hook.remove()
    score = dict.fromkeys(options, 0.0)
    for block, sigma in zip(model.blocks, sigmas):
        wq, wk, _, _ = _split(block.attn, config)
        _, _, values, _ = _rope_components(wq, wk, sigma, config.rope_style)
        top = values[:, 0]
        for s in options:
            score[s] += float(top[: s * (rope_dim // 2): s].sum() / values.sum())
    return max(options, key=lambda s: score[s])


def _second_moment(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).double()
    return rows.T @ rows / rows.shape[0]


def residual_weights(config: ModelConfig, span: Optional[int]) -> torch.Tensor:
    """Per source frequency, what a residual key without RoPE is multiplied by: the mean of the rotation
    exp(i w_f delta) it lost over key distances delta in [0, span] (1 for a slow pair, ~0 for a fast one),
    the least-squares constant for a key equally likely anywhere in the span; all ones without a span."""
    pairs = config.head_size // 2
    if span is None:
        return torch.ones(pairs, dtype=torch.complex128)
    omega = config.rope_base ** (-torch.arange(pairs, dtype=torch.float64) * 2 / config.head_size) * span
    mean = torch.where(omega > 1e-9, (1 - torch.exp(-1j * omega)) / (1j * omega.clamp_min(1e-9)),
                       torch.ones_like(omega, dtype=torch.complex128))
    return mean  # the key sits delta before the query: the score turned by exp(-i w_f delta)


def fit_layer(attention, sigma: torch.Tensor, config: ModelConfig, rank: int, rope_dim: int,
              stride: int, residual_span: Optional[int] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """One layer's MLA weights (wq, wkv_a, wkv_b, o) from a GQA attention module and its inputs' sigma."""
    wq, wk, wv, wo = _split(attention, config)
    heads, groups, d, dim = config.n_heads, config.kv_heads, config.head_size, config.dim
    rep, style = heads // groups, config.rope_style
    kc, weight, values, vectors = _rope_components(wq, wk, sigma, style)
    kept_freqs = list(range(0, stride * (rope_dim // 2), stride))
    # the shared RoPE key: at each kept frequency the top component, sum_g conj(v_g) w_g k_g
    top = vectors[kept_freqs, :, 0]  # [D/2, G]
    z = kc[:, kept_freqs] * weight[:, kept_freqs, None]  # [G, D/2, in]
    rope_key = torch.einsum("fg,gfa->fa", top.conj(), z)  # [D/2, in]
    coeff = (top / weight[:, kept_freqs].T).T  # [G, D/2]: key_g ~ coeff_g x rope_key
    # each head's residual key: its key minus what the RoPE key explains (all of it at dropped frequencies)
    residual = kc.clone()
    residual[:, kept_freqs] -= coeff[..., None] * rope_key[None]
    residual *= residual_weights(config, residual_span)[None, :, None]
    residual_rows = to_real(residual, style)  # [G, d, in], the source's channel layout
    # queries: RoPE part reads the shared key through conj(coeff); nope part is the source query
    qc = to_complex(wq, style)
    q_rope = torch.stack([coeff[h // rep, :, None].conj() * qc[h, kept_freqs] for h in range(heads)])
    q_rope_rows = _interleaved(q_rope)  # [H, D, in]
    source_scale = config.query_scale if config.query_scale is not None else d ** -0.5
    q_scale = source_scale * (d + rope_dim) ** 0.5
    wq_new = torch.cat((wq, q_rope_rows), dim=1) * q_scale  # per head [nope = source channels, rope]
    # joint K/V factorisation of [residual keys; values], weighted by what their errors cost
    key_metrics = [sum(wq[h] @ sigma @ wq[h].T for h in range(g * rep, (g + 1) * rep)) for g in range(groups)]
    value_metrics = [sum(wo[:, h].T @ wo[:, h] for h in range(g * rep, (g + 1) * rep)) for g in range(groups)]
    roots = [psd_power(m, 0.5) for m in key_metrics + value_metrics]
    inverse = [psd_power(m, -0.5) for m in key_metrics + value_metrics]
    rows = torch.cat([root @ part for root, part in zip(roots, list(residual_rows) + list(wv))])  # [2 G d, in]
    # balance: keys and values in units where each part's weighted energy is its share of the error
    energy = torch.einsum("ra,ab,rb->r", rows, sigma, rows).view(2, -1).sum(1)
    # (no residual keys, as from a one-KV-head source: nothing to balance)
    balance = (energy[1] / energy[0]).sqrt() if energy[0] > 1e-12 * energy[1] else energy.new_tensor(1.0)
    rows[: groups * d] *= balance
    cov = rows @ sigma @ rows.T
    eig_values, eig_vectors = torch.linalg.eigh(cov)
    basis = eig_vectors[:, -rank:].flip(-1)  # [2 G d, R]
    spread = eig_values[-rank:].flip(-1).clamp_min(1e-30).sqrt()  # latent channel RMS on the text
    latent_rows = (basis.T @ rows) / spread[:, None]  # [R, in], unit-RMS latent
    up = basis * spread[None]  # weighted rows ~ up @ latent
    up_parts = up.view(2 * groups, d, rank)
    k_up = [inverse[g] @ up_parts[g] / balance for g in range(groups)]
    v_up = [inverse[groups + g] @ up_parts[groups + g] for g in range(groups)]
    wkv_b = torch.cat([torch.cat((k_up[h // rep], v_up[h // rep])) for h in range(heads)])  # [H (d + d), R]
    rope_rows = _interleaved(rope_key[None])[0]  # [D, in]
    state = {"wq.weight": wq_new.reshape(heads * (d + rope_dim), dim),
             "wkv_a.weight": torch.cat((latent_rows, rope_rows)),
             "wkv_b.weight": wkv_b, "o.weight": wo.reshape(-1, heads * d).clone()}
    total = values.sum()
    facts = {"latent_energy_kept": float(eig_values[-rank:].sum() / eig_values.sum().clamp_min(1e-30)),
             "rope_energy": float(values[kept_freqs, 0].sum() / total.clamp_min(1e-30))}
    return state, facts


def _interleaved(rows: torch.Tensor) -> torch.Tensor:
    """Complex rows [..., n, in] -> real rows [..., 2n, in], pair i on channels 2i and 2i + 1 (DeepSeek's RoPE)."""
    return torch.stack((rows.real, rows.imag), dim=-2).flatten(-3, -2)


def pad_latent(model: Decoder, rank: int, rope_dim: Optional[int] = None) -> Decoder:
    """The same function with the latent widened to `rank` by zero channels (zero rows in the down-projection,
    zero columns in the up-projection) and, with `rope_dim`, the shared RoPE key widened to that many channels.
    vLLM's CPU MLA kernel only runs kv_lora_rank 512 with a 64-channel RoPE key (DeepSeek-V2's sizes), so a
    smaller conversion is served padded: it computes the same, but its cache row is rank + RoPE wide.

    A RoPE key of D channels rotates pair i at theta^(-2i/D); one of m * D channels rotates pair m * i at
    theta^(-2 m i/(m D)), the same angle. So each pair moves to m times its index, the pairs between stay zero
    in both the queries and the key (they add nothing to a score), and the queries take the factor
    sqrt((nope + m D) / (nope + D)) that undoes the wider head's smaller score scale."""
    config = model.config
    if config.attention != "mla" or config.rope_key_heads != 1:
        raise PlanError("--pad-latent widens a DeepSeek-layout MLA latent (--to mla --layout deepseek)")
    if rank < config.kv_lora_rank:
        raise PlanError(f"--pad-latent {rank} is below the latent's {config.kv_lora_rank} channels")
    old_rope = config.qk_rope_head_dim
    new_rope = old_rope if rope_dim is None else rope_dim
    if new_rope % old_rope:
        raise PlanError(f"--pad-rope {new_rope} is not a multiple of the RoPE key's {old_rope} channels")
    extra = rank - config.kv_lora_rank
    moved = _rope_channels(old_rope, new_rope)
    heads, nope = config.n_heads, config.qk_nope_head_dim
    query_gain = ((nope + new_rope) / (nope + old_rope)) ** 0.5
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    for i in range(config.n_layers):
        p = f"blocks.{i}.attn."
        down, up = state[p + "wkv_a.weight"], state[p + "wkv_b.weight"]
        latent, rope = down.split((config.kv_lora_rank, old_rope))
        wide_rope = rope.new_zeros(new_rope, down.shape[1])
        wide_rope[moved] = rope
        state[p + "wkv_a.weight"] = torch.cat((latent, down.new_zeros(extra, down.shape[1]), wide_rope))
        state[p + "wkv_b.weight"] = torch.cat((up, up.new_zeros(up.shape[0], extra)), dim=1)
        if p + "kv_norm.weight" in state:
            state[p + "kv_norm.weight"] = torch.cat((state[p + "kv_norm.weight"], down.new_ones(extra)))
        if new_rope != old_rope:
            q = state[p + "wq.weight"].view(heads, nope + old_rope, -1)
            wide_q = q.new_zeros(heads, nope + new_rope, q.shape[-1])
            wide_q[:, :nope] = q[:, :nope]
            wide_q[:, nope + moved] = q[:, nope:]
            state[p + "wq.weight"] = (wide_q * query_gain).reshape(heads * (nope + new_rope), -1)
    name = f"{config.name} [padded to {rank}" + (f" + RoPE {new_rope}]" if new_rope != old_rope else "]")
    padded = replace(config, kv_lora_rank=rank, qk_rope_head_dim=new_rope, name=name)
    return Decoder.from_state_dict(padded, state).to(model.dtype).train(model.training)


def _rope_channels(old: int, new: int) -> torch.Tensor:
    """Where each channel of an `old`-channel RoPE key sits in a `new`-channel key rotating at the same angles:
    pair i (channels 2i, 2i + 1 in DeepSeek's interleaved layout, the only one this conversion writes) becomes
    pair (new / old) * i."""
    pairs = torch.arange(old // 2) * (new // old)
    return torch.stack((2 * pairs, 2 * pairs + 1), -1).flatten()
