"""Hugging Face directories (config.json + model.safetensors [+ tokenizer files]) in and out.

Llama-family configs are written exactly as transformers' LlamaForCausalLM expects (Q/K in
rotate-half order, unfused projections), so a converted checkpoint opens in either library.
Dense MLA models with Llama's MLP and norms are written in DeepSeek-V2's format
(kvlab.checkpoints.hf_deepseek, which says where transformers differs), Gemma 3 models in
transformers' gemma3_text format (kvlab.checkpoints.hf_gemma: sliding layers, norms stored
minus one). Other configs
(GELU/LayerNorm character models) keep kvlab's own names and store the whole ModelConfig
under "kvlab_config".
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Optional

import torch

from kvlab.checkpoints.hf_deepseek import (FOLDED, MODEL_TYPE as DEEPSEEK, deepseek_config_json, deepseek_model_config,
                                           from_deepseek_state, is_deepseek_family, to_deepseek_state)
from kvlab.checkpoints.hf_gemma import (MODEL_TYPE as GEMMA3, from_gemma3_state, fused_projections,
                                        gemma3_config_json, gemma3_model_config, is_gemma3_family, to_gemma3_state)
from kvlab.checkpoints.hf_rope import norm_eps_and_rope_base
from kvlab.checkpoints.tokenizer import Tokenizer
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_config import hf_shape

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def is_llama_family(config: ModelConfig) -> bool:
    return (config.attention == "gqa" and config.mlp == "swiglu" and config.norm == "rmsnorm"
            and not config.bias and config.rope_style == "half")


def llama_config_json(config: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_size, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base, "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"), "name_or_path": config.name,
    }


def config_from_json(data: dict) -> ModelConfig:
    """The Decoder config of a config.json: its shape as the planner reads it (kvlab.plan.hf_config),
    plus the two numbers the planner has no use for, norm epsilon and RoPE base."""
    if "kvlab_config" in data:
        known = {f.name for f in fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in data["kvlab_config"].items() if k in known})
    if data.get("model_type") not in ("llama", "mistral", DEEPSEEK, GEMMA3):
        raise PlanError(f"kvlab loads Llama-family, Gemma 3 (gemma3_text) and dense DeepSeek-V2 HF checkpoints; "
                        f"this one is {data.get('model_type')!r}")
    shape, _ = hf_shape(data)
    if data["model_type"] == DEEPSEEK:
        return deepseek_model_config(data, shape)
    if data["model_type"] == GEMMA3:
        return gemma3_model_config(data, shape)
    if shape.qkv_bias or shape.o_bias or shape.mlp_bias:
        raise PlanError("kvlab loads Llama-family HF checkpoints without attention or MLP biases")
    if any(shape.windows):
        raise PlanError("this config slides a window over its layers; kvlab's HF loader runs full attention only")
    eps, theta = norm_eps_and_rope_base(data)
    return ModelConfig(
        vocab_size=shape.vocab, dim=shape.hidden, n_layers=shape.layers, n_heads=shape.q_heads,
        n_kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn_dim=shape.intermediate, norm_eps=float(eps),
        rope_base=float(theta), max_seq_len=shape.max_context, tie_embeddings=shape.tied,
        name=data.get("name_or_path") or "hf-model")


def to_hf_state(model: Decoder) -> dict[str, torch.Tensor]:
    """kvlab parameter names -> LlamaForCausalLM names, fused projections split back."""
    c = model.config
    q, kv = c.n_heads * c.head_size, c.kv_heads * c.head_size
    state = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        state["lm_head.weight"] = model.lm_head.weight
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        wq, wk, wv = block.attn.qkv.weight.split((q, kv, kv))
        gate, up = block.mlp.gate_up.weight.split(c.ffn_size)
        state.update({
            p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk, p + "self_attn.v_proj.weight": wv,
            p + "self_attn.o_proj.weight": block.attn.o.weight, p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": block.mlp.down.weight,
            p + "input_layernorm.weight": block.attn_norm.weight,
            p + "post_attention_layernorm.weight": block.mlp_norm.weight,
        })
    return {name: t.detach().contiguous() for name, t in state.items()}


def from_hf_state(state: dict[str, torch.Tensor], config: ModelConfig,
                  folded: bool = False) -> dict[str, torch.Tensor]:
    """HF tensor names -> kvlab's; `folded`: a DeepSeek directory whose latent norm kvlab folded in."""
    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise PlanError(f"model.safetensors lacks {name}")
        return state[name]

    if config.attention == "mla":
        return from_deepseek_state(config, get, folded)
    if is_gemma3_family(config):
        return from_gemma3_state(config, get)

    ours = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = get("lm_head.weight")
    for i in range(config.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        ours.update(fused_projections(get, i))
        ours[b + "attn_norm.weight"] = get(p + "input_layernorm.weight")
        ours[b + "mlp_norm.weight"] = get(p + "post_attention_layernorm.weight")
    return ours


def save_hf(model: Decoder, directory: str, tokenizer: Optional[Tokenizer] = None) -> None:
    """Write `directory` so that `load_hf` (and, for Llama and Gemma 3 configs, transformers) reads it back."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    if is_llama_family(model.config):
        config, state = llama_config_json(model.config, model.dtype), to_hf_state(model)
    elif is_deepseek_family(model.config):
        config = deepseek_config_json(model.config, _DTYPE_NAMES.get(model.dtype, "float32"))
        state = to_deepseek_state(model.state_dict(), model.config)
    elif is_gemma3_family(model.config):
        config = gemma3_config_json(model.config, _DTYPE_NAMES.get(model.dtype, "float32"))
        state = to_gemma3_state(model.state_dict(), model.config)
    else:
        config = {"architectures": ["KvlabDecoder"], "kvlab_config": model.config.to_dict(),
                  "torch_dtype": _DTYPE_NAMES.get(model.dtype, "float32")}
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_embeddings:
            state.pop("lm_head.weight")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)


def load_hf(directory: str, dtype: torch.dtype = torch.float32) -> tuple[Decoder, Optional[Tokenizer]]:
    """The model in `dtype` (eval mode) and, when the directory has tokenizer.json, its tokenizer."""
    from safetensors.torch import load_file

    config_path, weights_path = os.path.join(directory, "config.json"), os.path.join(directory, "model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise PlanError(f"{directory} is not a model directory: {os.path.basename(path)} is missing")
    try:
        with open(config_path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise PlanError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{config_path} must hold a JSON object, not a {type(data).__name__}")
    try:  # a config with missing fields or wrong types, or tensors of the wrong names or shapes: the user's files
        config = config_from_json(data)  # before the weights: an unsupported model fails fast
        try:
            state = load_file(weights_path)
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error type on a bad file
            raise PlanError(f"{weights_path} is not a readable safetensors file: {error}") from None
        if "kvlab_config" not in data:
            state = from_hf_state(state, config, data.get(FOLDED) is True)
        model = Decoder.from_state_dict(config, state)
    except PlanError as error:
        raise PlanError(f"{directory}: {error}") from None
    except (TypeError, ValueError, KeyError, RuntimeError) as error:
        raise PlanError(f"{directory} does not describe a model kvlab can build: {type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}") from None
    tokenizer = Tokenizer.load(directory) if os.path.isfile(os.path.join(directory, "tokenizer.json")) else None
    return model.to(dtype).eval(), tokenizer
