"""Model specs: what the planner needs to know about a model, and nothing more.

A model is a list of layers, each with its own attention description, because real
models mix kinds (Gemma's 5-local-1-global, gpt-oss's alternating windows, DeepSeek's
MLA, Llama 4's chunked local attention, Qwen3-Next's linear-attention layers). Every loader
(presets, config.json, GGUF header) produces a `ModelSpec`, and every formula reads only this.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from kvlab.plan.errors import PlanError

FULL = "full"
SLIDING = "sliding"
MLA = "mla"
CHUNKED = "chunked"  # Llama 4's local attention: a query sees only its own chunk of `window` tokens
STATE = "state"  # linear attention or a state-space layer: a fixed-size state per sequence, no per-token cache
ATTENTION_KINDS = (FULL, SLIDING, MLA, CHUNKED, STATE)
WINDOWED_KINDS = (SLIDING, CHUNKED)


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention, as far as the KV cache is concerned.

    For `mla` layers the cache holds one latent row of `latent_row` = `kv_lora_rank +
    rope_key_heads * qk_rope_head_dim` elements per token (no separate V); `k_head_dim`/
    `v_head_dim` then describe the up-projected heads, used only for attention FLOPs.
    DeepSeek-V2 has one decoupled RoPE key shared by every query head (`rope_key_heads=1`);
    kvlab's exact MLA conversion of a GQA model keeps one per source KV head (kvlab.checkpoints.mla).

    A `chunked` layer holds at most `window` tokens (the chunk its newest query attends in).
    A `state` layer holds `state_elements` values per sequence whatever the context (a
    recurrent state and a short convolution window); its `kv_heads` is the head count that
    tensor parallelism splits the state by. A `kv_shared` layer reads an earlier layer's
    cache (Gemma 3n/4's last layers) and holds none of its own.
    """

    kind: str
    q_heads: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: Optional[int] = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    rope_key_heads: int = 1
    state_elements: int = 0
    kv_shared: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise PlanError(f"unknown attention kind {self.kind!r}; expected one of {ATTENTION_KINDS}")
        for name in ("q_heads", "kv_heads", "k_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if self.kind in WINDOWED_KINDS and (self.window is None or self.window <= 0):
            raise PlanError(f"a {self.kind} layer needs a positive window, got {self.window!r}")
        if self.kind == STATE and self.state_elements <= 0:
            raise PlanError("a state layer needs a positive state size")
        if self.kind == MLA and (self.kv_lora_rank <= 0 or self.qk_rope_head_dim < 0 or self.rope_key_heads <= 0):
            raise PlanError("an MLA layer needs kv_lora_rank > 0, qk_rope_head_dim >= 0 and rope_key_heads > 0")

    @property
    def latent_row(self) -> int:
        """Elements an MLA layer caches per token: the latent plus its decoupled RoPE key(s)."""
        return self.kv_lora_rank + self.rope_key_heads * self.qk_rope_head_dim

    @property
    def is_mla(self) -> bool:
        return self.kind == MLA

    @property
    def is_state(self) -> bool:
        return self.kind == STATE

    def cached_tokens(self, context: int) -> int:
        """Tokens this layer holds for a sequence of `context` tokens (0 for state and shared layers)."""
        if self.kv_shared or self.kind == STATE:
            return 0
        if self.kind in WINDOWED_KINDS:
            return min(context, self.window)
        return context


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: layers plus what weights and FLOPs need."""

    name: str
    layers: tuple[LayerAttention, ...]
    params_total: Optional[int] = None
    params_active: Optional[int] = None
    hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    tied_embeddings: bool = False
    max_context: Optional[int] = None
    weight_bytes: Optional[int] = None  # known exactly (a GGUF's real tensor bytes, a quantised config's tensors)
    weight_format: Optional[str] = None  # how those bytes are stored ("mxfp4 ...", "GGUF Q4_K ..."), when known
    checkpoint_bytes: Optional[int] = None  # what the checkpoint ships, when more than the engine loads (MTP layers)
    params_estimated: bool = False
    intermediate_size: Optional[int] = None  # the widest dense MLP (vLLM's profiled activation peak grows with it)
    experts_per_token: Optional[int] = None  # MoE: routed experts per token ...
    expert_intermediate_size: Optional[int] = None  # ... and each one's width
    source: str = "explicit"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanError("a model needs at least one layer")
        for name in ("params_total", "params_active", "hidden_size", "vocab_size", "max_context"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise PlanError(f"{name} must be positive, got {value!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def active_params(self) -> Optional[int]:
        return self.params_active if self.params_active is not None else self.params_total

    @property
    def first_attention(self) -> LayerAttention:
        """The first layer with attention heads: what the headline shape describes."""
        return next((layer for layer in self.layers if not layer.is_state), self.layers[0])

    @property
    def q_heads(self) -> int:
        return self.first_attention.q_heads

    @property
    def kv_heads(self) -> int:
        return self.first_attention.kv_heads

    @property
    def head_dim(self) -> int:
        return self.first_attention.k_head_dim

    @property
    def has_mla(self) -> bool:
        return any(layer.is_mla for layer in self.layers)

    @property
    def has_windows(self) -> bool:
        return any(layer.kind in WINDOWED_KINDS for layer in self.layers)

    @property
    def has_state(self) -> bool:
        return any(layer.is_state for layer in self.layers)

    def with_kv_heads(self, kv_heads: int) -> "ModelSpec":
        """The same model with `kv_heads` KV heads on every layer (MHA, GQA or MQA what-if).

        MLA layers become plain full attention with the up-projected head dims; state layers
        (no KV heads) are left as they are.
        """
        if kv_heads <= 0:
            raise PlanError(f"--kv-heads must be positive, got {kv_heads}")
        layers = []
        for layer in self.layers:
            if layer.is_state:
                layers.append(layer)
                continue
            if kv_heads > layer.q_heads:
                raise PlanError(f"--kv-heads {kv_heads} exceeds the {layer.q_heads} query heads")
            if layer.q_heads % kv_heads:
                raise PlanError(f"--kv-heads {kv_heads} must divide the {layer.q_heads} query heads")
            kind = FULL if layer.is_mla else layer.kind
            layers.append(replace(layer, kind=kind, kv_heads=kv_heads, kv_lora_rank=0, qk_rope_head_dim=0,
                                  rope_key_heads=1))
        return replace(self, layers=tuple(layers), name=f"{self.name} [kv_heads={kv_heads}]")

    def with_kv_window(self, window: int, sinks: int = 0) -> "ModelSpec":
        """Served with a sinks + window cache (StreamingLLM): every full-attention layer holds at most
        sinks + window tokens, counted exactly like a sliding-window layer of that width."""
        if window <= 0 or sinks < 0:
            raise PlanError(f"--kv-window must be positive and --sink-tokens non-negative, got {window}, {sinks}")
        layers = tuple(replace(layer, kind=SLIDING, window=window + sinks) if layer.kind == FULL
                       else replace(layer, window=min(layer.window, window + sinks)) if layer.kind == SLIDING
                       else layer for layer in self.layers)
        return replace(self, layers=layers, name=f"{self.name} [sinks {sinks} + window {window}]")

    def with_mla(self, kv_lora_rank: int, qk_rope_head_dim: int) -> "ModelSpec":
        """The same model with MLA latent attention on every layer (TransMLA/MHA2MLA what-if)."""
        if kv_lora_rank <= 0 or qk_rope_head_dim < 0:
            raise PlanError("--mla-rank must be positive and --mla-rope-dim non-negative")
        layers = tuple(
            layer if layer.is_state else
            replace(layer, kind=MLA, window=None, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                    rope_key_heads=1)
            for layer in self.layers
        )
        return replace(self, layers=layers, name=f"{self.name} [mla {kv_lora_rank}+{qk_rope_head_dim}]")


def uniform_layers(
    num_layers: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_head_dim: Optional[int] = None,
) -> tuple[LayerAttention, ...]:
    """`num_layers` identical full-attention layers: the common dense-transformer case."""
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise PlanError(f"layers must be a positive integer, got {num_layers!r}")
    layer = LayerAttention(FULL, q_heads, kv_heads, head_dim, v_head_dim or head_dim)
    return (layer,) * num_layers


def estimate_dense_params(
    num_layers: int,
    hidden: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: Optional[int] = None,
    vocab: int = 32000,
    tied: bool = False,
) -> int:
    """Parameter count of a Llama-style decoder (SwiGLU MLP, RMSNorm), for shapes given without one."""
    from kvlab.plan.hf_shape import Shape, count_params  # hf_shape imports this module

    ffn = intermediate or 256 * ((8 * hidden // 3 + 255) // 256)
    shape = Shape(layers=num_layers, hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                  intermediate=ffn, vocab=vocab, tied=tied, max_context=1)
    return count_params(shape)[0]
