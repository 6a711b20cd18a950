"""kvlab's Gemma 3 models as Hugging Face `gemma3_text` directories (Gemma3ForCausalLM), and back.

The config is what transformers' Gemma3TextConfig (5.x) reads and writes: `layer_types`
naming each layer "sliding_attention" or "full_attention", `sliding_window`, the RoPE bases
per layer type under `rope_parameters` ({"full_attention": {"rope_type": "default",
"rope_theta": ...}, "sliding_attention": {...}}), `query_pre_attn_scalar` (the logits are
scaled by its -1/2 power), `hidden_activation: gelu_pytorch_tanh` (GeGLU), and no softcapping
(`final_logit_softcapping` / `attn_logit_softcapping` null; Gemma 2 had them, Gemma 3 has
not). The same bases are also written under transformers 4.x's names, `rope_theta` and
`rope_local_base_freq`, which 5.x reads too when `rope_parameters` is absent and otherwise
consumes without effect, so older readers (vLLM pinned to 4.x, llama.cpp's converter) agree.

Tensors carry transformers' names. Gemma's four norms per block map as
input_layernorm = kvlab's attn_norm, post_attention_layernorm = post_attn_norm (on the
attention's output), pre_feedforward_layernorm = mlp_norm, post_feedforward_layernorm =
post_mlp_norm, plus self_attn.q_norm / k_norm (one head_dim vector shared by every head).
Gemma3RMSNorm computes x * (1 + w), so every stored norm is kvlab's multiplier minus one,
and one is added back on reading (in fp32: m - 1 and 1 + (m - 1) are exact for m >= 0.5).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvlab.checkpoints.hf_rope import check_rope_kind
from kvlab.nn.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_shape import Shape

MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"
ACTIVATION = "gelu_pytorch_tanh"  # transformers' tanh-approximated GELU, kvlab's GeGLU
DEFAULT_THETA = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}  # Gemma3TextConfig.default_theta
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
# kvlab name -> transformers name, per block; every one is an RMSNorm stored minus one
BLOCK_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
               "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
               "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


def is_gemma3_family(config: ModelConfig) -> bool:
    """A model Gemma3ForCausalLM computes exactly: GeGLU, RMSNorm, q/k norms, post-norms,
    embeddings scaled by sqrt(dim), rotate-half RoPE, no biases, a whole-number query scalar."""
    return (config.attention == "gqa" and config.mlp == "geglu" and config.norm == "rmsnorm" and not config.bias
            and config.rope_style == "half" and config.qk_norm and config.post_norms
            and config.embed_scale == config.dim ** 0.5 and _query_pre_attn_scalar(config) is not None)


def _query_pre_attn_scalar(config: ModelConfig):
    """The integer s with s ** -0.5 == the model's query scale (transformers types it int), or None."""
    if config.query_scale is None:
        return config.head_size
    scalar = round(config.query_scale ** -2)
    return scalar if scalar > 0 and scalar ** -0.5 == config.query_scale else None


def gemma3_config_json(config: ModelConfig, dtype_name: str) -> dict:
    types = list(config.layer_types or [FULL_ATTENTION] * config.n_layers)
    local = config.rope_base if config.rope_local_base is None else config.rope_local_base
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_size, "hidden_activation": ACTIVATION,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": {FULL_ATTENTION: {"rope_type": "default", "rope_theta": config.rope_base},
                            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": local}},
        "rope_theta": config.rope_base, "rope_local_base_freq": local,
        "attention_bias": False, "attention_dropout": 0.0,
        "query_pre_attn_scalar": _query_pre_attn_scalar(config),
        "sliding_window": config.sliding_window or None, "layer_types": types,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
        "torch_dtype": dtype_name, "name_or_path": config.name,
    }


def gemma3_model_config(data: dict, shape: Shape) -> ModelConfig:
    """The Decoder config of a gemma3_text config.json (already read into `shape` by the planner,
    which gives the layers' windows); what kvlab cannot compute is refused, not ignored."""
    if shape.qkv_bias or shape.o_bias:
        raise PlanError("kvlab's Gemma 3 has no attention biases; this config has attention_bias")
    activation = data.get("hidden_activation", ACTIVATION)
    if activation != ACTIVATION:
        raise PlanError(f"kvlab's Gemma 3 MLP is GeGLU with {ACTIVATION}; this config has {activation!r}")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if data.get(key) is not None:
            raise PlanError(f"kvlab does not softcap logits; this config has {key} {data[key]!r}")
    if data.get("use_bidirectional_attention"):
        raise PlanError("kvlab's decoders are causal; this config has use_bidirectional_attention")
    eps = data.get("rms_norm_eps", 1e-6)
    scalar = data.get("query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR)
    for key, value in (("rms_norm_eps", eps), ("query_pre_attn_scalar", scalar)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise PlanError(f"config.json's {key} must be a positive number, got {value!r}")
    full, local = (_rope_theta(data, kind) for kind in (FULL_ATTENTION, SLIDING_ATTENTION))
    windows = shape.windows or (None,) * shape.layers
    window = next((w for w in windows if w), 0)
    query_scale = None if scalar == shape.head_dim else float(scalar) ** -0.5
    return ModelConfig(
        vocab_size=shape.vocab, dim=shape.hidden, n_layers=shape.layers, n_heads=shape.q_heads,
        n_kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn_dim=shape.intermediate, mlp="geglu",
        norm_eps=float(eps), rope_base=full, max_seq_len=shape.max_context, tie_embeddings=shape.tied,
        qk_norm=True, post_norms=True, embed_scale=shape.hidden ** 0.5, query_scale=query_scale,
        sliding_window=window, layer_types=[SLIDING_ATTENTION if w else FULL_ATTENTION for w in windows],
        rope_local_base=local, name=data.get("name_or_path") or "hf-model")


def _rope_theta(data: dict, kind: str) -> float:
    """One layer type's RoPE base: `rope_parameters[kind]` (5.x), else the 4.x key, else transformers' default."""
    parameters = data.get("rope_parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise PlanError(f"config.json's rope_parameters must be an object, got {parameters!r}")
    legacy = {FULL_ATTENTION: "rope_theta", SLIDING_ATTENTION: "rope_local_base_freq"}[kind]
    if parameters and isinstance(parameters.get(kind), dict):
        check_rope_kind(parameters[kind], f"rope_parameters.{kind}")
        theta = parameters[kind].get("rope_theta", data.get(legacy, DEFAULT_THETA[kind]))
    else:
        if kind == FULL_ATTENTION and data.get("rope_scaling"):
            check_rope_kind(data["rope_scaling"], "rope_scaling")  # 4.x applied it to the global layers only
        theta = data.get(legacy, DEFAULT_THETA[kind])
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not math.isfinite(theta) or theta <= 0:
        raise PlanError(f"config.json's RoPE base for {kind} layers must be a positive number, got {theta!r}")
    return float(theta)


def to_gemma3_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """kvlab parameter names -> Gemma3ForCausalLM names: fused projections split, norms minus one."""
    q, kv = config.n_heads * config.head_size, config.kv_heads * config.head_size
    ours = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": _minus_one(state["norm.weight"])}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        wq, wk, wv = state[b + "attn.qkv.weight"].split((q, kv, kv))
        gate, up = state[b + "mlp.gate_up.weight"].split(config.ffn_size)
        ours.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                     p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": state[b + "attn.o.weight"],
                     p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                     p + "mlp.down_proj.weight": state[b + "mlp.down.weight"]})
        for mine, theirs in BLOCK_NORMS.items():
            ours[p + theirs + ".weight"] = _minus_one(state[b + mine + ".weight"])
    return {name: t.detach().contiguous() for name, t in ours.items()}


def from_gemma3_state(config: ModelConfig, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma3ForCausalLM names -> kvlab's, norms plus one; `get` raises the loader's one-line error."""
    ours = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": _plus_one(get("model.norm.weight"))}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = get("lm_head.weight")
    for i in range(config.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        ours.update(fused_projections(get, i))
        for mine, theirs in BLOCK_NORMS.items():
            ours[b + mine + ".weight"] = _plus_one(get(p + theirs + ".weight"))
    return ours


def fused_projections(get: Callable[[str], torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s attention and MLP matrices from transformers' Llama-layout names (Llama and
    Gemma 3 share them) under kvlab's fused names: q, k, v stacked; gate, up stacked."""
    p, b = f"model.layers.{layer}.", f"blocks.{layer}."
    return {b + "attn.qkv.weight": torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
            b + "attn.o.weight": get(p + "self_attn.o_proj.weight"),
            b + "mlp.gate_up.weight": torch.cat((get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight"))),
            b + "mlp.down.weight": get(p + "mlp.down_proj.weight")}


def _minus_one(multiplier: torch.Tensor) -> torch.Tensor:
    """The stored form of a norm's multiplier, computed in fp32 (then the tensor's own dtype)."""
    return (multiplier.float() - 1).to(multiplier.dtype)


def _plus_one(stored: torch.Tensor) -> torch.Tensor:
    """A stored Gemma norm's multiplier in fp32, as Gemma3RMSNorm computes `1.0 + weight.float()`."""
    return stored.float() + 1
