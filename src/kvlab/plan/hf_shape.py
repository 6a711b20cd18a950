"""The architecture facts of a decoder, and the parameter count that follows from them.

Every config.json family reader reduces its config to one `Shape`: widths, which
projections carry biases, how many norms a block has, whether the MLP is gated, and the
MoE and MLA details. The count below then walks the model the way its weights are laid
out, so a count that disagrees with a model card points at one flag, not at a formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvlab.plan.spec import FULL, MLA, SLIDING, LayerAttention


@dataclass(frozen=True)
class MoE:
    """Routed experts (and optional always-on shared experts) replacing the dense MLP."""

    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0  # total width of the shared expert(s); 0 for none
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate (hidden -> 1) on the shared expert
    router_bias: bool = False
    expert_bias: bool = False
    dense_layers: frozenset[int] = frozenset()  # layers that keep the dense MLP


@dataclass(frozen=True)
class Latent:
    """DeepSeek's multi-head latent attention (MLA) projections.

    `rope_key_heads` and `norm` are kvlab's extensions for exact conversions
    (kvlab.checkpoints.mla): one decoupled RoPE key per source KV head instead of one shared,
    and no RMSNorm on the latent. DeepSeek-V2 itself is (1, True).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries come straight from the hidden state
    rope_key_heads: int = 1
    norm: bool = True


@dataclass(frozen=True)
class Mixer:
    """One layer's token mixer, for models whose layers differ in more than a window.

    Gemma 4's global layers have their own KV heads and head dim; Qwen3-Next's linear-attention
    layers have no KV cache at all. A family reader that states `mixers` gives each layer its
    cache description and the parameters of its attention (q/k norms included).
    """

    attention: LayerAttention
    params: int
    extra_params: int = 0  # other per-layer weights outside attention and MLP (Gemma 4's per-layer input gate)
    intermediate: int = 0  # this layer's dense MLP width when it differs (Gemma 4's double-wide layers)


@dataclass(frozen=True)
class Shape:
    """One decoder-only transformer, as far as its KV cache and parameter count go."""

    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_context: int
    windows: tuple[Optional[int], ...] = ()  # per layer: a sliding window, or None for full
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over head_dim on queries and on keys (Qwen3, Gemma 3)
    sinks: bool = False  # one learned attention-sink logit per query head (gpt-oss)
    gated_mlp: bool = True  # SwiGLU/GeGLU: gate, up, down; else up, down
    mlp_bias: bool = False
    norm_params: int = 1  # per channel: 1 for RMSNorm, 2 for LayerNorm (weight and bias)
    norms_per_layer: int = 2
    learned_positions: int = 0  # rows of a learned position table (GPT-2)
    moe: Optional[MoE] = None
    latent: Optional[Latent] = None
    mixers: tuple[Mixer, ...] = ()  # per layer, when layers differ (replaces the uniform attention)
    extra_params: int = 0  # weights outside the layers beyond embeddings and the final norm
    notes: tuple[str, ...] = field(default_factory=tuple)

    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention as the planner sees it."""
        if self.mixers:
            return tuple(mixer.attention for mixer in self.mixers)
        if self.latent is not None:
            mla = self.latent
            layer = LayerAttention(MLA, self.q_heads, self.kv_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                                   mla.v_head_dim, kv_lora_rank=mla.kv_lora_rank,
                                   qk_rope_head_dim=mla.qk_rope_head_dim, rope_key_heads=mla.rope_key_heads)
            return (layer,) * self.layers
        windows = self.windows or (None,) * self.layers
        return tuple(
            LayerAttention(SLIDING if window else FULL, self.q_heads, self.kv_heads, self.head_dim, self.head_dim,
                           window=window)
            for window in windows
        )


def count_params(shape: Shape) -> tuple[int, Optional[int]]:
    """(total, active) parameters; active is None for a dense model.

    Active counts every weight a token touches: all of attention, embeddings and
    lm_head, shared experts, the router, and `top_k` routed experts (Mixtral's "12.9B
    active" convention). Buffers (rotary tables, DeepSeek-V3's routing bias) are not
    parameters and are not counted.
    """
    s = shape
    norms = s.norms_per_layer * s.norm_params * s.hidden
    uniform = 0 if s.mixers else attention_params(s)
    total = active = 0
    for index in range(s.layers):
        mixer = s.mixers[index] if s.mixers else None
        fixed = norms + (mixer.params + mixer.extra_params if mixer else uniform)
        mlp_total, mlp_active = _mlp(s, index, mixer.intermediate if mixer else 0)
        total += fixed + mlp_total
        active += fixed + mlp_active
    outside = (s.vocab * s.hidden * (1 if s.tied else 2) + s.learned_positions * s.hidden + s.norm_params * s.hidden
               + s.extra_params)
    return total + outside, (active + outside if s.moe else None)


def attention_params(s: Shape) -> int:
    """Parameters of one uniform attention block: projections, biases, q/k norms, sinks."""
    if s.latent is not None:
        return _latent_attention(s, s.latent)
    q_width, kv_width = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    weights = s.hidden * (q_width + 2 * kv_width) + q_width * s.hidden
    biases = (q_width + 2 * kv_width if s.qkv_bias else 0) + (s.hidden if s.o_bias else 0)
    norms = 2 * s.head_dim if s.qk_norm else 0
    sinks = s.q_heads if s.sinks else 0
    return weights + biases + norms + sinks


def _latent_attention(s: Shape, mla: Latent) -> int:
    q_width = s.q_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    bias = 1 if s.qkv_bias else 0
    if mla.q_lora_rank:
        query = s.hidden * mla.q_lora_rank + bias * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * q_width
    else:
        query = s.hidden * q_width
    compressed = mla.kv_lora_rank + mla.rope_key_heads * mla.qk_rope_head_dim
    kv_down = s.hidden * compressed + bias * compressed + (mla.kv_lora_rank if mla.norm else 0)  # the latent's RMSNorm
    kv_up = mla.kv_lora_rank * s.q_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = s.q_heads * mla.v_head_dim * s.hidden + (s.hidden if s.o_bias else 0)
    return query + kv_down + kv_up + out


def _mlp_params(hidden: int, intermediate: int, gated: bool, bias: bool) -> int:
    matrices = 3 if gated else 2
    biases = ((2 if gated else 1) * intermediate + hidden) if bias else 0
    return matrices * hidden * intermediate + biases


def _mlp(s: Shape, index: int, intermediate: int = 0) -> tuple[int, int]:
    """(total, active) MLP parameters of layer `index` (`intermediate` overrides the dense width)."""
    moe = s.moe
    if moe is None or index in moe.dense_layers:
        dense = _mlp_params(s.hidden, intermediate or s.intermediate, s.gated_mlp, s.mlp_bias)
        return dense, dense
    expert = _mlp_params(s.hidden, moe.expert_intermediate, s.gated_mlp, moe.expert_bias)
    router = s.hidden * moe.experts + (moe.experts if moe.router_bias else 0)
    shared = _mlp_params(s.hidden, moe.shared_intermediate, s.gated_mlp, False) if moe.shared_intermediate else 0
    shared += s.hidden if moe.shared_gate else 0
    always = router + shared
    return always + moe.experts * expert, always + moe.top_k * expert
