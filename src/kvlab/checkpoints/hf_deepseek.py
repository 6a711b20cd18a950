"""kvlab's dense MLA models as DeepSeek-V2 Hugging Face directories, and back.

The config is DeepSeek-V2's (`model_type: deepseek_v2`, `kv_lora_rank`, `qk_rope_head_dim`,
`qk_nope_head_dim`, `v_head_dim`, `q_lora_rank: null`) with every layer dense
(`first_k_dense_replace` = the layer count), and the tensors carry transformers' names
(`self_attn.q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), so
kvlab's planner reads it like any DeepSeek config. `lm_head.weight` is always written (a tied
model's copy of the embedding): vLLM's DeepseekV2 never ties it.

A model with one shared RoPE key (kvlab.checkpoints.mla_aware, `--layout deepseek`) is written
in DeepSeek-V2's layout exactly. Its latent is not normalised, and DeepSeek's always is (RMSNorm
kv_a_layernorm); the norm is folded in exactly by its epsilon: the latent rows of
kv_a_proj_with_mqa are scaled by a tiny alpha, so that mean(latent^2) is at most 1e-6 x eps for
ANY input (a bound from the weights: the norm's input x has |x|^2 <= dim x max(gain)^2), where
RMSNorm is a fixed scale 1/sqrt(eps); kv_a_layernorm's weight sqrt(eps)/alpha undoes it. The
result differs from the unnormalised latent by under 1e-6 relative, in transformers and vLLM
alike, which both compute the norm in fp32. It needs rms_norm_eps = 1e-6 (transformers' latent
norm uses 1e-6 whatever the config says; the conversion sets it), and fp32 or bf16 weights
(alpha x weight underflows fp16). `kvlab_latent_norm_folded: true` in config.json (ignored by
transformers and vLLM) tells kvlab's loader to unfold it, so training sees ordinary weights.

Models with a RoPE key per source KV head (kvlab.checkpoints.mla, `--layout kvlab`) use two kvlab
extensions, stated in config.json under names DeepSeek never uses:
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
DEEPSEEK_EPS = 1e-6  # the epsilon of transformers' DeepseekV2 latent norm, fixed in its code
FOLDED = "kvlab_latent_norm_folded"
FOLD_ERROR = 1e-6  # the fold's largest relative change of the latent, for any input
_ATTENTION = {"q_proj": "wq", "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
              "o_proj": "o"}


def is_deepseek_family(config: ModelConfig) -> bool:
    """An MLA model DeepSeek-V2's layout describes: SwiGLU MLP, RMSNorm, no biases."""
    return config.attention == "mla" and config.mlp == "swiglu" and config.norm == "rmsnorm" and not config.bias


def folds_latent_norm(config: ModelConfig) -> bool:
    """Whether the model is written in DeepSeek's exact layout with its latent norm folded in."""
    return config.rope_key_heads == 1 and not config.latent_norm and config.norm_eps == DEEPSEEK_EPS


def deepseek_config_json(config: ModelConfig, dtype_name: str) -> dict:
    data = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,  # MLA's up-projected heads: one K/V per query head
        "kv_lora_rank": config.kv_lora_rank, "q_lora_rank": None, "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim, "v_head_dim": config.v_head_dim,
        "first_k_dense_replace": config.n_layers, "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base,
        "rope_interleave": config.rope_style == "interleaved", "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": dtype_name, "name_or_path": config.name,
    }
    if folds_latent_norm(config):
        data[FOLDED] = True
    elif config.rope_key_heads != 1 or not config.latent_norm:
        data.update(kvlab_rope_key_heads=config.rope_key_heads, kvlab_latent_norm=config.latent_norm)
    return data


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
        v_head_dim=latent.v_head_dim, rope_key_heads=latent.rope_key_heads,
        latent_norm=latent.norm and data.get(FOLDED) is not True,
        name=data.get("name_or_path") or "hf-model")


def to_deepseek_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """kvlab parameter names -> DeepseekV2ForCausalLM names, fused gate/up split back, the latent norm
    folded in when `folds_latent_norm`."""
    ours = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
            "lm_head.weight": state["embed.weight"].clone() if config.tie_embeddings else state["lm_head.weight"]}
    fold = folds_latent_norm(config)
    for i in range(config.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, mine in _ATTENTION.items():
            if b + f"attn.{mine}.weight" in state:
                ours[p + f"self_attn.{theirs}.weight"] = state[b + f"attn.{mine}.weight"]
        if fold:
            down, gain = fold_latent_norm(state[b + "attn.wkv_a.weight"], state[b + "attn_norm.weight"],
                                          config.kv_lora_rank, config.norm_eps)
            ours[p + "self_attn.kv_a_proj_with_mqa.weight"], ours[p + "self_attn.kv_a_layernorm.weight"] = down, gain
        gate, up = state[b + "mlp.gate_up.weight"].split(config.ffn_size)
        ours.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                     p + "mlp.down_proj.weight": state[b + "mlp.down.weight"],
                     p + "input_layernorm.weight": state[b + "attn_norm.weight"],
                     p + "post_attention_layernorm.weight": state[b + "mlp_norm.weight"]})
    return {name: t.detach().contiguous() for name, t in ours.items()}


def fold_latent_norm(wkv_a: torch.Tensor, input_gain: torch.Tensor, rank: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_a_proj_with_mqa, kv_a_layernorm weight) computing the unnormalised latent through an RMSNorm.

    The norm's input x is RMSNorm(h) x gain, so |x|^2 <= dim x max(gain)^2 and the latent
    c = W x has mean(c^2) <= |W|_2^2 dim max(gain)^2 / rank =: bound. With the latent rows
    scaled by alpha = sqrt(2 FOLD_ERROR eps / bound), mean((alpha c)^2) <= 2 FOLD_ERROR eps, so
    RMSNorm(alpha c) = alpha c / sqrt(eps) x (1 + at most FOLD_ERROR); the weight sqrt(eps)/alpha
    gives back c.
    """
    latent, rope = wkv_a[:rank].double(), wkv_a[rank:]
    gain = input_gain.detach().double()
    bound = torch.linalg.matrix_norm(latent, ord=2) ** 2 * gain.numel() * gain.abs().max() ** 2 / rank
    alpha = float((2 * FOLD_ERROR * eps / bound.clamp_min(1e-300)).sqrt())
    down = torch.cat(((latent * alpha).to(wkv_a.dtype), rope))
    return down, torch.full((rank,), eps ** 0.5 / alpha, dtype=wkv_a.dtype)


def unfold_latent_norm(wkv_a: torch.Tensor, gain: torch.Tensor, rank: int, eps: float) -> torch.Tensor:
    """The inverse of `fold_latent_norm`: the unnormalised latent's rows (kv_a_layernorm dropped)."""
    latent = wkv_a[:rank].double() * (gain.double()[:, None] / eps ** 0.5)
    return torch.cat((latent.to(wkv_a.dtype), wkv_a[rank:]))


def from_deepseek_state(config: ModelConfig, get: Callable[[str], torch.Tensor],
                        folded: bool = False) -> dict[str, torch.Tensor]:
    """DeepseekV2ForCausalLM names -> kvlab's; `get` raises the loader's one-line error on a missing tensor.
    `folded`: the directory's latent norm is a fold (FOLDED), taken back out."""
    ours = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = get("lm_head.weight")
    for i in range(config.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, mine in _ATTENTION.items():
            if mine != "kv_norm" or config.latent_norm:
                ours[b + f"attn.{mine}.weight"] = get(p + f"self_attn.{theirs}.weight")
        if folded:
            ours[b + "attn.wkv_a.weight"] = unfold_latent_norm(
                ours[b + "attn.wkv_a.weight"], get(p + "self_attn.kv_a_layernorm.weight"), config.kv_lora_rank,
                config.norm_eps)
        ours[b + "mlp.gate_up.weight"] = torch.cat((get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")))
        ours[b + "mlp.down.weight"] = get(p + "mlp.down_proj.weight")
        ours[b + "attn_norm.weight"] = get(p + "input_layernorm.weight")
        ours[b + "mlp_norm.weight"] = get(p + "post_attention_layernorm.weight")
    return ours
