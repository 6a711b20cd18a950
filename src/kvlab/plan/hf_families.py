"""One reader per config.json model family: config dict in, `Shape` out.

The defaults are those of the transformers config classes (5.x), copied as data so the
planner never imports transformers. Two fields have no default here on purpose: the layer
count and the hidden size. A config that omits them describes no particular model, and
planning the config class's 7B default from it would be a wrong answer that looks right.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from kvlab.plan.errors import PlanError
from kvlab.plan.hf_fields import Fields
from kvlab.plan.hf_shape import Latent, MoE, Shape
from kvlab.plan.hf_windows import after, every_layer, per_layer, periodic, window_if

_LLAMA_LIKE = dict(vocab_size=32000, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=None,
                   head_dim=None, max_position_embeddings=2048, tie_word_embeddings=False,
                   attention_bias=False, mlp_bias=False)
_QWEN = dict(vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=False, head_dim=None,
             use_sliding_window=False, sliding_window=4096, max_window_layers=28, attention_bias=False,
             decoder_sparse_step=1, mlp_only_layers=None)


@dataclass(frozen=True)
class Family:
    """A model_type's defaults and the function that reads its config."""

    defaults: Mapping[str, Any]
    read: Callable[[Fields], Shape]


def _split(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise PlanError(f"hidden size {hidden} is not a multiple of {heads} attention heads; state head_dim")
    return hidden // heads


def base_fields(f: Fields, head_dim: int = 0) -> dict[str, Any]:
    """The fields every Llama-style config shares; an explicit `head_dim` wins over hidden/heads."""
    hidden = f.size("hidden_size")
    heads = f.size("num_attention_heads")
    return dict(
        layers=f.size("num_hidden_layers"), hidden=hidden, q_heads=heads,
        kv_heads=f.optional_size("num_key_value_heads") or heads,
        head_dim=head_dim or f.optional_size("head_dim") or _split(hidden, heads),
        intermediate=f.size("intermediate_size"), vocab=f.size("vocab_size"),
        tied=f.flag("tie_word_embeddings"), max_context=f.size("max_position_embeddings"),
    )


def _llama(f: Fields) -> Shape:
    bias = f.flag("attention_bias")
    return Shape(**base_fields(f), qkv_bias=bias, o_bias=bias, mlp_bias=f.flag("mlp_bias"))


def _windowed_everywhere(f: Fields) -> Shape:
    """Mistral, Phi-3: a non-null `sliding_window` applies to every layer."""
    layers = f.size("num_hidden_layers")
    return Shape(**base_fields(f), windows=every_layer(layers, f.optional_size("sliding_window")))


def _mixtral(f: Fields) -> Shape:
    moe = MoE(f.size("num_local_experts", "num_experts"), f.size("num_experts_per_tok"), f.size("intermediate_size"))
    return replace(_windowed_everywhere(f), moe=moe)


def _qwen2(f: Fields) -> Shape:
    layers = f.size("num_hidden_layers")
    windows = after(f, layers, window_if(f, "use_sliding_window"), f.count("max_window_layers"))
    return Shape(**base_fields(f), windows=windows, qkv_bias=True)


def qwen_moe(f: Fields, shared: bool) -> MoE:
    layers, step = f.size("num_hidden_layers"), f.size("decoder_sparse_step")
    dense = set(f.int_list("mlp_only_layers")) | {i for i in range(layers) if (i + 1) % step}
    return MoE(f.size("num_experts", "num_local_experts"), f.size("num_experts_per_tok"),
               f.size("moe_intermediate_size"),
               shared_intermediate=f.count("shared_expert_intermediate_size") if shared else 0,
               shared_gate=shared, dense_layers=frozenset(dense))


def _qwen2_moe(f: Fields) -> Shape:
    layers, max_window = f.size("num_hidden_layers"), f.count("max_window_layers")
    # transformers' Qwen2-MoE rule (unlike Qwen2's): even-indexed layers below max_window_layers slide
    windows = per_layer(f, layers, window_if(f, "use_sliding_window"),
                        lambda i: (i + 1) % 2 != 0 and i < max_window)
    return Shape(**base_fields(f), windows=windows, qkv_bias=f.flag("qkv_bias"), moe=qwen_moe(f, shared=True))


def _qwen3(f: Fields) -> Shape:
    layers, bias = f.size("num_hidden_layers"), f.flag("attention_bias")
    windows = after(f, layers, window_if(f, "use_sliding_window"), f.count("max_window_layers"))
    return Shape(**base_fields(f), windows=windows, qkv_bias=bias, o_bias=bias, qk_norm=True)


def _qwen3_moe(f: Fields) -> Shape:
    layers, bias = f.size("num_hidden_layers"), f.flag("attention_bias")
    windows = every_layer(layers, window_if(f, "use_sliding_window"))
    return Shape(**base_fields(f), windows=windows, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=qwen_moe(f, False))


def _gemma(f: Fields) -> Shape:
    bias = f.flag("attention_bias")
    return Shape(**base_fields(f), qkv_bias=bias, o_bias=bias)


def _gemma2(f: Fields) -> Shape:
    layers, bias = f.size("num_hidden_layers"), f.flag("attention_bias")
    windows = periodic(f, layers, f.optional_size("sliding_window"), 2)
    return Shape(**base_fields(f), windows=windows, qkv_bias=bias, o_bias=bias, norms_per_layer=4)


def _gemma3(f: Fields) -> Shape:
    layers, bias = f.size("num_hidden_layers"), f.flag("attention_bias")
    windows = periodic(f, layers, f.optional_size("sliding_window"), f.size("sliding_window_pattern"))
    return Shape(**base_fields(f), windows=windows, qkv_bias=bias, o_bias=bias, qk_norm=True, norms_per_layer=4)


def _starcoder2(f: Fields) -> Shape:
    layers, bias = f.size("num_hidden_layers"), f.flag("use_bias")
    return Shape(**base_fields(f), windows=every_layer(layers, f.optional_size("sliding_window")), qkv_bias=bias,
                 o_bias=bias, gated_mlp=False, mlp_bias=bias, norm_params=2)


def _gpt_neox(f: Fields) -> Shape:
    bias = f.flag("attention_bias")
    return Shape(**base_fields(f), qkv_bias=bias, o_bias=bias, gated_mlp=False, mlp_bias=True, norm_params=2)


def _falcon(f: Fields) -> Shape:
    """Falcon's three attention layouts: MHA, multi-query (7B), grouped (40B/180B "new decoder")."""
    hidden, heads = f.size("hidden_size", "n_embed"), f.size("num_attention_heads", "n_head")
    new_decoder = f.flag("new_decoder_architecture")
    if new_decoder:
        kv_heads = f.optional_size("num_kv_heads", "n_head_kv") or heads
    else:
        kv_heads = 1 if f.flag("multi_query") else heads
    norms_in_parallel = f.optional_size("num_ln_in_parallel_attn") or (2 if new_decoder else 1)
    norms = 2 if not f.flag("parallel_attn") or norms_in_parallel == 2 else 1
    bias = f.flag("bias")
    return Shape(layers=f.size("num_hidden_layers", "n_layer"), hidden=hidden, q_heads=heads, kv_heads=kv_heads,
                 head_dim=_split(hidden, heads), intermediate=f.optional_size("ffn_hidden_size") or 4 * hidden,
                 vocab=f.size("vocab_size"), tied=f.flag("tie_word_embeddings"),
                 max_context=f.size("max_position_embeddings"), qkv_bias=bias, o_bias=bias, gated_mlp=False,
                 mlp_bias=bias, norm_params=2, norms_per_layer=norms)


def _gpt2_style(f: Fields, kv_heads_of: Callable[[int], int]) -> Shape:
    """GPT-2 and GPTBigCode: learned positions, LayerNorm, biases everywhere, a 4x GELU MLP."""
    hidden, heads = f.size("n_embd", "hidden_size"), f.size("n_head", "num_attention_heads")
    positions = f.size("n_positions", "max_position_embeddings")
    return Shape(layers=f.size("n_layer", "num_hidden_layers"), hidden=hidden, q_heads=heads,
                 kv_heads=kv_heads_of(heads), head_dim=_split(hidden, heads),
                 intermediate=f.optional_size("n_inner") or 4 * hidden, vocab=f.size("vocab_size"),
                 tied=f.flag("tie_word_embeddings"), max_context=positions, qkv_bias=True, o_bias=True,
                 gated_mlp=False, mlp_bias=True, norm_params=2, learned_positions=positions)


def _gpt_bigcode(f: Fields) -> Shape:
    multi_query = f.flag("multi_query")
    return _gpt2_style(f, lambda heads: 1 if multi_query else heads)


def _deepseek(f: Fields) -> Shape:
    """DeepSeek-V2/V3: MLA attention, the first `first_k_dense_replace` layers dense, the rest MoE.

    A config whose dense prefix covers every layer (what `kvlab convert --to mla` writes) is a
    dense model: its expert fields are not read. `kvlab_rope_key_heads` and `kvlab_latent_norm`
    are kvlab's extensions (see `Latent`); DeepSeek's own configs never state them.
    """
    latent = Latent(f.size("kv_lora_rank"), f.count("qk_nope_head_dim"), f.size("qk_rope_head_dim"),
                    f.size("v_head_dim"), q_lora_rank=f.optional_size("q_lora_rank") or 0,
                    rope_key_heads=f.size("kvlab_rope_key_heads"), norm=f.flag("kvlab_latent_norm"))
    layers = f.size("num_hidden_layers")
    moe = None
    if _dense_prefix(f) < layers:
        expert = f.size("moe_intermediate_size")
        moe = MoE(f.size("n_routed_experts"), f.size("num_experts_per_tok"), expert,
                  shared_intermediate=expert * f.count("n_shared_experts"),
                  dense_layers=frozenset(range(_dense_prefix(f))))
    mtp = f.config.get("num_nextn_predict_layers")
    notes = (f"{mtp} multi-token-prediction layer(s) not counted as loaded (transformers and vLLM without MTP "
             "speculation skip them; a quantised checkpoint's checkpoint_bytes includes them)",) if mtp else ()
    bias = f.flag("attention_bias")
    return Shape(**base_fields(f, head_dim=latent.qk_nope_head_dim + latent.qk_rope_head_dim), qkv_bias=bias,
                 o_bias=bias, moe=moe, latent=latent, notes=notes)


def _dense_prefix(f: Fields) -> int:
    """`first_k_dense_replace`, where DeepSeek-V3's class allows null for "none"."""
    return 0 if f.raw("first_k_dense_replace") is None else f.count("first_k_dense_replace")


def _gpt_oss(f: Fields) -> Shape:
    layers, bias = f.size("num_hidden_layers"), f.flag("attention_bias")
    moe = MoE(f.size("num_local_experts", "num_experts"), f.size("num_experts_per_tok"), f.size("intermediate_size"),
              router_bias=True, expert_bias=True)
    windows = periodic(f, layers, f.optional_size("sliding_window"), 2)
    return Shape(**base_fields(f), windows=windows, qkv_bias=bias, o_bias=bias, sinks=True, moe=moe)


def _phimoe(f: Fields) -> Shape:
    """Phi-3.5-MoE: LayerNorms, biased attention and lm_head, 16 experts with top-2 routing."""
    layers, bias = f.size("num_hidden_layers"), f.flag("attention_bias")
    moe = MoE(f.size("num_local_experts"), f.size("num_experts_per_tok"), f.size("intermediate_size"))
    return Shape(**base_fields(f), windows=every_layer(layers, f.optional_size("sliding_window")), qkv_bias=bias,
                 o_bias=bias, norm_params=2, moe=moe,
                 extra_params=f.size("vocab_size") if f.flag("lm_head_bias") else 0)


_MISTRAL = _LLAMA_LIKE | dict(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072,
                              sliding_window=4096)
_GEMMA = _LLAMA_LIKE | dict(vocab_size=256000, intermediate_size=24576, num_attention_heads=16,
                            num_key_value_heads=16, head_dim=256, max_position_embeddings=8192,
                            tie_word_embeddings=True)
_GEMMA2 = _GEMMA | dict(intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, sliding_window=4096)
_GEMMA3 = _GEMMA2 | dict(vocab_size=262208, max_position_embeddings=131072, sliding_window_pattern=6)
_FALCON = dict(vocab_size=65024, num_attention_heads=71, num_kv_heads=None, max_position_embeddings=2048,
               tie_word_embeddings=True, multi_query=True, new_decoder_architecture=False, parallel_attn=True,
               bias=False, ffn_hidden_size=None, num_ln_in_parallel_attn=None)
_GPT2 = dict(vocab_size=50257, n_positions=1024, n_head=12, n_inner=None, tie_word_embeddings=True)
_DEEPSEEK_V2 = _LLAMA_LIKE | dict(vocab_size=102400, first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
                                  n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128,
                                  qk_rope_head_dim=64, v_head_dim=128, num_experts_per_tok=None,
                                  moe_intermediate_size=1407, kvlab_rope_key_heads=1, kvlab_latent_norm=True)

FAMILIES: dict[str, Family] = {
    "llama": Family(_LLAMA_LIKE, _llama),
    "mistral": Family(_MISTRAL, _windowed_everywhere),
    "mixtral": Family(_MISTRAL | dict(sliding_window=None, num_local_experts=8, num_experts_per_tok=2), _mixtral),
    "qwen2": Family(_QWEN | dict(intermediate_size=22016, num_attention_heads=32, num_key_value_heads=32), _qwen2),
    "qwen2_moe": Family(_QWEN | dict(intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
                                     moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                     num_experts_per_tok=4, num_experts=60, qkv_bias=True), _qwen2_moe),
    "qwen3": Family(_QWEN | dict(intermediate_size=22016, num_attention_heads=32, num_key_value_heads=32,
                                 head_dim=128), _qwen3),
    "qwen3_moe": Family(_QWEN | dict(intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                                     moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128), _qwen3_moe),
    "gemma": Family(_GEMMA, _gemma),
    "gemma2": Family(_GEMMA2, _gemma2),
    "gemma3_text": Family(_GEMMA3, _gemma3),
    "phi3": Family(_LLAMA_LIKE | dict(vocab_size=32064, intermediate_size=8192, max_position_embeddings=4096,
                                      sliding_window=None), _windowed_everywhere),
    "falcon": Family(_FALCON, _falcon),
    "RefinedWebModel": Family(_FALCON, _falcon),  # Falcon-7B's pre-transformers name
    "RefinedWeb": Family(_FALCON | dict(new_decoder_architecture=True), _falcon),  # Falcon-40B's
    "gpt_bigcode": Family(_GPT2 | dict(multi_query=True), _gpt_bigcode),
    "gpt2": Family(_GPT2, lambda f: _gpt2_style(f, lambda heads: heads)),
    "starcoder2": Family(dict(vocab_size=49152, intermediate_size=12288, num_attention_heads=24,
                              num_key_value_heads=2, head_dim=None, max_position_embeddings=4096,
                              sliding_window=None, use_bias=True, tie_word_embeddings=True), _starcoder2),
    "gpt_neox": Family(dict(vocab_size=50432, num_attention_heads=64, intermediate_size=24576, head_dim=None,
                            num_key_value_heads=None, max_position_embeddings=2048, tie_word_embeddings=False,
                            attention_bias=True), _gpt_neox),
    "deepseek_v2": Family(_DEEPSEEK_V2, _deepseek),
    "deepseek_v3": Family(_DEEPSEEK_V2 | dict(vocab_size=129280, intermediate_size=18432, num_attention_heads=128,
                                              num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                                              num_experts_per_tok=8, first_k_dense_replace=3,
                                              moe_intermediate_size=2048, max_position_embeddings=4096), _deepseek),
    "phimoe": Family(_LLAMA_LIKE | dict(vocab_size=32064, intermediate_size=6400, num_key_value_heads=8,
                                        max_position_embeddings=131072, sliding_window=None, num_local_experts=16,
                                        num_experts_per_tok=2, lm_head_bias=False), _phimoe),
    "gpt_oss": Family(dict(vocab_size=201088, intermediate_size=2880, head_dim=64, num_attention_heads=64,
                           num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
                           max_position_embeddings=131072, num_local_experts=128, num_experts_per_tok=4,
                           attention_bias=True), _gpt_oss),
}
