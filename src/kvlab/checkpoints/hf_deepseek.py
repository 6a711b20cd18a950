"""kvlab's dense MLA models as DeepSeek-V2 Hugging Face directories, and back.

The config is DeepSeek-V2's (`model_type: deepseek_v2`, `kv_lora_rank`, `qk_rope_head_dim`,
`qk_nope_head_dim`, `v_head_dim`, `q_lora_rank: null`) with every layer dense
(`first_k_dense_replace` = the layer count), and the tensors carry transformers' names
(`self_attn.q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), so
kvlab's planner reads it like any DeepSeek config.

Two kvlab extensions, stated in config.json under names DeepSeek never uses, make a GQA
conversion exact (kvlab.checkpoints.mla):
- `kvlab_rope_key_heads` G: `kv_a_proj_with_mqa` yields G decoupled RoPE keys (rank + G * rope
  rows), query head h reads key h // (heads / G); DeepSeek has G = 1;
- `kvlab_latent_norm: false`: no RMSNorm on the latent, and no `kv_a_layernorm` tensor.
transformers' DeepseekV2 knows neither: it always normalises the latent and shares one RoPE
key, so it cannot load such a directory exactly (with G > 1 its shapes do not even match).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvlab.checkpoints.hf_rope import norm_eps_and_rope_base
from kvlab.nn.config import ModelConfig
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_shape import Shape

MODEL_TYPE = "deepseek_v2"
_ATTENTION = {"q_proj": "wq", "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
              "o_proj": "o"}


def is_deepseek_family(config: ModelConfig) -> bool:
    """An MLA model DeepSeek-V2's layout describes: SwiGLU MLP, RMSNorm, no biases."""
    return config.attention == "mla" and config.mlp == "swiglu" and config.norm == "rmsnorm" and not config.bias


def deepseek_config_json(config: ModelConfig, dtype_name: str) -> dict:
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,  # MLA's up-projected heads: one K/V per query head
        "kv_lora_rank": config.kv_lora_rank, "q_lora_rank": None, "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim, "v_head_dim": config.v_head_dim,
        "first_k_dense_replace": config.n_layers, "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base,
        "rope_interleave": config.rope_style == "interleaved", "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "kvlab_rope_key_heads": config.rope_key_heads, "kvlab_latent_norm": config.latent_norm,
        "torch_dtype": dtype_name, "name_or_path": config.name,
    }


def deepseek_model_config(data: dict, shape: Shape) -> ModelConfig:
    """The Decoder config of a dense DeepSeek-V2 config.json (already read into `shape`)."""
    latent = shape.latent
    if shape.moe is not None:
        raise PlanError("kvlab loads dense DeepSeek-V2 checkpoints only (first_k_dense_replace = the layer count); "
                        "this one routes experts")
    if latent.q_lora_rank:
        raise PlanError("kvlab's MLA takes queries straight from the hidden state; this config has q_lora_rank")
    if shape.qkv_bias or shape.o_bias:
        raise PlanError("kvlab's MLA has no attention biases; this config has attention_bias")
    eps, theta = norm_eps_and_rope_base(data)
    interleave = data.get("rope_interleave", True)  # DeepSeek-V2's RoPE pairs adjacent channels
    if not isinstance(interleave, bool):
        raise PlanError(f"config.json's rope_interleave must be true or false, got {interleave!r}")
    return ModelConfig(
        vocab_size=shape.vocab, dim=shape.hidden, n_layers=shape.layers, n_heads=shape.q_heads,
        ffn_dim=shape.intermediate, norm_eps=float(eps), rope_base=float(theta),
        rope_style="interleaved" if interleave else "half", max_seq_len=shape.max_context,
        tie_embeddings=shape.tied, attention="mla", kv_lora_rank=latent.kv_lora_rank,
        qk_rope_head_dim=latent.qk_rope_head_dim, qk_nope_head_dim=latent.qk_nope_head_dim,
        v_head_dim=latent.v_head_dim, rope_key_heads=latent.rope_key_heads, latent_norm=latent.norm,
        name=data.get("name_or_path") or "hf-model")


def to_deepseek_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """kvlab parameter names -> DeepseekV2ForCausalLM names, fused gate/up split back."""
    ours = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, mine in _ATTENTION.items():
            if b + f"attn.{mine}.weight" in state:
                ours[p + f"self_attn.{theirs}.weight"] = state[b + f"attn.{mine}.weight"]
        gate, up = state[b + "mlp.gate_up.weight"].split(config.ffn_size)
        ours.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                     p + "mlp.down_proj.weight": state[b + "mlp.down.weight"],
                     p + "input_layernorm.weight": state[b + "attn_norm.weight"],
                     p + "post_attention_layernorm.weight": state[b + "mlp_norm.weight"]})
    return {name: t.detach().contiguous() for name, t in ours.items()}


def from_deepseek_state(config: ModelConfig, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepseekV2ForCausalLM names -> kvlab's; `get` raises the loader's one-line error on a missing tensor."""
    ours = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = get("lm_head.weight")
    for i in range(config.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, mine in _ATTENTION.items():
            if mine != "kv_norm" or config.latent_norm:
                ours[b + f"attn.{mine}.weight"] = get(p + f"self_attn.{theirs}.weight")
        ours[b + "mlp.gate_up.weight"] = torch.cat((get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")))
        ours[b + "mlp.down.weight"] = get(p + "mlp.down_proj.weight")
        ours[b + "attn_norm.weight"] = get(p + "input_layernorm.weight")
        ours[b + "mlp_norm.weight"] = get(p + "post_attention_layernorm.weight")
    return ours
