"""Named model shapes, so a user can ask `kvlab plan llama-3-8b` with nothing else.

Shapes come from each model's published config.json; parameter counts from its model card.
"""

from __future__ import annotations

import difflib
from dataclasses import replace

from kvlab.plan.errors import PlanError
from kvlab.plan.preset_configs import CONFIG_PRESETS
from kvlab.plan.spec import FULL, MLA, SLIDING, LayerAttention, ModelSpec, estimate_dense_params, uniform_layers


def _dense(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, params: int,
           context: int, vocab: int, tied: bool = False) -> ModelSpec:
    return ModelSpec(name, uniform_layers(layers, heads, kv_heads, head_dim), params_total=params,
                     hidden_size=hidden, vocab_size=vocab, tied_embeddings=tied, max_context=context,
                     source="preset")


def _seed_40_layer(kv_heads: int) -> ModelSpec:
    """The seed's 40-layer, 32-query-head worked example (parameters estimated from its shape)."""
    params = estimate_dense_params(40, 4096, 32, kv_heads, 128, intermediate=11008, vocab=32000)
    return ModelSpec(f"seed-40l-kv{kv_heads}", uniform_layers(40, 32, kv_heads, 128), params_total=params,
                     hidden_size=4096, vocab_size=32000, max_context=4096, params_estimated=True, source="preset")


def _mistral_7b() -> ModelSpec:
    """Mistral-7B-v0.1: every layer a 4,096-token sliding window."""
    layer = LayerAttention(SLIDING, 32, 8, 128, 128, window=4096)
    return ModelSpec("mistral-7b", (layer,) * 32, params_total=7_241_732_096, hidden_size=4096,
                     vocab_size=32000, max_context=32768, source="preset")


def _deepseek_v2() -> ModelSpec:
    """DeepSeek-V2: 60 MLA layers, latent 512 + shared RoPE key 64; 236B total, 21B active (MoE)."""
    layer = LayerAttention(MLA, 128, 128, 192, 128, kv_lora_rank=512, qk_rope_head_dim=64)
    return ModelSpec("deepseek-v2", (layer,) * 60, params_total=236_000_000_000, params_active=21_000_000_000,
                     hidden_size=5120, vocab_size=102400, max_context=163840, source="preset")


def _gemma3_270m() -> ModelSpec:
    """Gemma 3 270M: MQA, head dim 256, a 512-token window on 5 of every 6 layers."""
    layers = tuple(
        LayerAttention(FULL, 4, 1, 256, 256) if (index + 1) % 6 == 0
        else LayerAttention(SLIDING, 4, 1, 256, 256, window=512)
        for index in range(18)
    )
    return ModelSpec("gemma-3-270m", layers, params_total=268_098_176, hidden_size=640, vocab_size=262144,
                     tied_embeddings=True, max_context=32768, source="preset")


PRESETS = {
    "llama-2-7b": _dense("llama-2-7b", 32, 32, 32, 128, 4096, 6_738_415_616, 4096, 32000),
    "llama-2-13b": _dense("llama-2-13b", 40, 40, 40, 128, 5120, 13_015_864_320, 4096, 32000),
    "llama-2-70b": _dense("llama-2-70b", 80, 64, 8, 128, 8192, 68_976_648_192, 4096, 32000),
    "llama-3-8b": _dense("llama-3-8b", 32, 32, 8, 128, 4096, 8_030_261_248, 8192, 128256),
    "llama-3.1-8b": _dense("llama-3.1-8b", 32, 32, 8, 128, 4096, 8_030_261_248, 131072, 128256),
    "llama-3-70b": _dense("llama-3-70b", 80, 64, 8, 128, 8192, 70_553_706_496, 8192, 128256),
    "mistral-7b": _mistral_7b(),
    "seed-40l-kv32": _seed_40_layer(32),
    "seed-40l-kv8": _seed_40_layer(8),
    "deepseek-v2": _deepseek_v2(),
    "smollm2-135m": _dense("smollm2-135m", 30, 9, 3, 64, 576, 134_515_008, 8192, 49152, tied=True),
    "gemma-3-270m": _gemma3_270m(),
}


def preset(name: str) -> ModelSpec:
    """The preset called `name` (case-insensitive); a one-line error with close matches otherwise."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key in CONFIG_PRESETS:  # checkpoints that ship quantised: read from their published config.json
        from kvlab.plan.hf_config import spec_from_hf_config
        return replace(spec_from_hf_config(CONFIG_PRESETS[key], key), source="preset (published config.json)")
    close = difflib.get_close_matches(key, preset_names(), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known presets: {', '.join(preset_names())}"
    raise PlanError(f"unknown model {name!r}{hint}")


def preset_names() -> list[str]:
    return list(PRESETS) + list(CONFIG_PRESETS)

