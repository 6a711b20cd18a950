"""Presets for checkpoints that ship quantised: their published config.json, read as any config.json is.

These models are planned from their config (shape fields and `quantization_config` as published),
so `kvlab plan gpt-oss-20b` counts the MXFP4 experts and DeepSeek-V3's FP8 block scales exactly as
`kvlab plan path/to/config.json` would (kvlab.plan.quantized).
"""

from __future__ import annotations

_GPT_OSS_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
GPT_OSS_20B = dict(model_type="gpt_oss", num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=201088, sliding_window=128, max_position_embeddings=131072, attention_bias=True,
                   tie_word_embeddings=False, torch_dtype="bfloat16", quantization_config=_GPT_OSS_MXFP4,
                   layer_types=["sliding_attention", "full_attention"] * 12)
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128,
                    layer_types=["sliding_attention", "full_attention"] * 18)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                   n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512,
                   q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
                   max_position_embeddings=163840, num_nextn_predict_layers=1, tie_word_embeddings=False,
                   torch_dtype="bfloat16", quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                                                "quant_method": "fp8", "weight_block_size": [128, 128]})

CONFIG_PRESETS = {"gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B, "deepseek-v3": DEEPSEEK_V3}
