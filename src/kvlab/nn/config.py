"""One dataclass describes every decoder kvlab builds, from a character GPT to SmolLM2.

The config is the contract between checkpoints (which fill it in from a file), the model
(which builds modules from it) and the planner (`to_plan_spec`), so measured cache bytes
can be compared with planned bytes for exactly the model that ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

from kvlab.plan.errors import PlanError
from kvlab.plan.hf_shape import Latent, Shape, count_params
from kvlab.plan.spec import FULL, MLA, SLIDING, LayerAttention, ModelSpec

MLP_KINDS = ("swiglu", "gelu", "geglu")
NORM_KINDS = ("rmsnorm", "layernorm")
ATTENTION_KINDS = ("gqa", "mla")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # transformers' layer_types
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and choices of a decoder-only transformer.

    `attention="gqa"` covers MHA (n_kv_heads == n_heads), GQA and MQA (n_kv_heads == 1).
    `attention="mla"` is DeepSeek-V2 multi-head latent attention: each query head has
    `qk_nope_head_dim + qk_rope_head_dim` channels, the cache holds `kv_lora_rank` latent
    channels plus `rope_key_heads` decoupled RoPE keys of `qk_rope_head_dim` per token.
    DeepSeek-V2 has one RoPE key shared by every head and RMS-normalises the latent; kvlab's
    exact conversion of a GQA model (kvlab.checkpoints.mla) keeps one RoPE key per source KV
    head (query head h reads key h // (n_heads / rope_key_heads)) and `latent_norm=False`.
    `qk_nope_head_dim` may be 0 there: every key channel keeps its RoPE.

    Gemma 3's extras: `qk_norm` (an RMSNorm over each query and key head before RoPE),
    `post_norms` (RMSNorms on the attention and MLP outputs before each residual add),
    `embed_scale` (embeddings multiplied by sqrt(dim)), `query_scale` (the logits' scale,
    query_pre_attn_scalar ** -0.5), GeGLU (`mlp="geglu"`: tanh-GELU gate), and
    `layer_types` naming each layer full or sliding: a sliding layer's query at position t
    sees keys t - sliding_window < p <= t, with RoPE base `rope_local_base`. Norm weights are
    held as the multipliers themselves (Gemma's checkpoints store them minus one).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None  # None: MHA
    head_dim: Optional[int] = None  # None: dim // n_heads
    ffn_dim: Optional[int] = None  # None: 4 * dim (gelu) or Llama's 8/3 rounding (swiglu)
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    bias: bool = False
    rope_base: float = 10000.0
    rope_style: str = "half"
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attention: str = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_key_heads: int = 1
    latent_norm: bool = True
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float = 1.0
    query_scale: Optional[float] = None  # None: head_size ** -0.5
    sliding_window: int = 0
    layer_types: Optional[Sequence[str]] = None  # None: every layer full
    rope_local_base: Optional[float] = None  # sliding layers' RoPE base; None: rope_base
    name: str = "model"

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, field_name) <= 0:
                raise PlanError(f"{field_name} must be positive, got {getattr(self, field_name)}")
        if self.mlp not in MLP_KINDS or self.norm not in NORM_KINDS or self.attention not in ATTENTION_KINDS:
            raise PlanError(f"unknown mlp/norm/attention {self.mlp!r}/{self.norm!r}/{self.attention!r}")
        if self.n_heads % self.kv_heads:
            raise PlanError(f"{self.kv_heads} KV heads must divide the {self.n_heads} query heads")
        if self.attention == "mla" and (min(self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim) <= 0
                                        or self.qk_nope_head_dim < 0):
            raise PlanError("MLA needs positive kv_lora_rank, qk_rope_head_dim and v_head_dim, "
                            "and a non-negative qk_nope_head_dim")
        if self.attention == "mla" and (self.rope_key_heads <= 0 or self.n_heads % self.rope_key_heads):
            raise PlanError(f"{self.rope_key_heads} RoPE key heads must divide the {self.n_heads} query heads")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # JSON gives a list
            if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise PlanError(f"layer_types must name {' or '.join(LAYER_TYPES)} for each of the "
                                f"{self.n_layers} layers")
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window <= 0:
                raise PlanError("sliding layers need a positive sliding_window")
            if SLIDING_ATTENTION in self.layer_types and self.attention == "mla":
                raise PlanError("kvlab's MLA attends fully: sliding layers are not supported there")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.mlp == "gelu":
            return 4 * self.dim
        return 256 * ((8 * self.dim // 3 + 255) // 256)

    def window_of(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer` (keys it sees, itself included), None if it attends fully."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @property
    def sliding_windows(self) -> tuple[Optional[int], ...]:
        """Each layer's sliding window (None for a layer that attends fully): the model's own sliding layers,
        not a cache policy (that is EngineConfig.kv_window)."""
        return tuple(self.window_of(layer) for layer in range(self.n_layers))

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates: the whole head, or MLA's decoupled RoPE part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    def with_kv_heads(self, kv_heads: int) -> "ModelConfig":
        return replace(self, n_kv_heads=kv_heads)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_shape(self) -> Shape:
        """The architecture facts the planner counts parameters from (kvlab.plan.hf_shape), so a
        model built here and a config.json describing it are counted by the same function."""
        latent = None
        if self.attention == "mla":
            latent = Latent(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                            rope_key_heads=self.rope_key_heads, norm=self.latent_norm)
        bias = self.bias and self.attention == "gqa"  # kvlab's MLA projections have no biases
        return Shape(
            layers=self.n_layers, hidden=self.dim, q_heads=self.n_heads,
            kv_heads=self.n_heads if latent else self.kv_heads,
            head_dim=self.qk_nope_head_dim + self.qk_rope_head_dim if latent else self.head_size,
            intermediate=self.ffn_size, vocab=self.vocab_size, tied=self.tie_embeddings, max_context=self.max_seq_len,
            windows=self.sliding_windows if any(self.sliding_windows) else (), qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm,
            gated_mlp=self.mlp in ("swiglu", "geglu"), mlp_bias=self.bias,
            norm_params=2 if self.norm == "layernorm" and self.bias else 1,
            norms_per_layer=4 if self.post_norms else 2, latent=latent,
        )

    def param_count(self) -> int:
        """Parameters of the model `Decoder(config)` builds (tied embeddings counted once)."""
        return count_params(self.to_shape())[0]

    def to_plan_spec(self) -> ModelSpec:
        """The planner's view of this model, so plan and measurement share one description."""
        if self.attention == "mla":
            layer = LayerAttention(MLA, self.n_heads, self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
                                   self.v_head_dim, kv_lora_rank=self.kv_lora_rank,
                                   qk_rope_head_dim=self.qk_rope_head_dim, rope_key_heads=self.rope_key_heads)
            layers = (layer,) * self.n_layers
        else:
            layers = tuple(
                LayerAttention(SLIDING, self.n_heads, self.kv_heads, self.head_size, self.head_size, window=window)
                if window else LayerAttention(FULL, self.n_heads, self.kv_heads, self.head_size, self.head_size)
                for window in self.sliding_windows)
        return ModelSpec(
            name=self.name,
            layers=layers,
            params_total=self.param_count(),
            hidden_size=self.dim,
            vocab_size=self.vocab_size,
            tied_embeddings=self.tie_embeddings,
            max_context=self.max_seq_len,
            source="kvlab.nn.ModelConfig",
        )


def plan_spec(config: dict) -> ModelSpec:
    """kvlab.plan's view of a saved model config (a ModelConfig as a dict, as results files keep it)."""
    return ModelConfig(**config).to_plan_spec()
