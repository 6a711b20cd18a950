"""config.json families whose layers differ in more than a window: Llama 4, Gemma 4, Qwen3-Next.

Llama 4 runs chunked local attention on three layers of four. Gemma 4's global layers have
their own KV-head count and head dim (and, with `attention_k_eq_v`, no V projection), and its
last `num_kv_shared_layers` layers reuse earlier layers' caches. Qwen3-Next replaces three
attention layers of four with Gated DeltaNet linear attention, whose cache is a fixed state
per sequence. Each reader here states every layer as a `Mixer`, so the cache and the
parameter count follow the layer, not a model-wide shape. Defaults are transformers 5.x's
config classes, copied as data, as in `kvlab.plan.hf_families`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from kvlab.plan.errors import PlanError
from kvlab.plan.hf_families import Family, base_fields, qwen_moe
from kvlab.plan.hf_fields import Fields
from kvlab.plan.hf_shape import Mixer, MoE, Shape, attention_params
from kvlab.plan.spec import CHUNKED, FULL, SLIDING, STATE, LayerAttention


def _layer_types(f: Fields, layers: int, default: Callable[[int], str], allowed: tuple[str, ...]) -> list[str]:
    """`layer_types` as stated (checked against `allowed`), else the family's default pattern."""
    types = f.config.get("layer_types")
    if types is None:
        return [default(index) for index in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise PlanError(f"layer_types must list one type for each of the {layers} layers")
    unknown = sorted({repr(kind) for kind in types if kind not in allowed})
    if unknown:
        raise PlanError(f"unsupported layer_types {', '.join(unknown)}; expected one of {', '.join(allowed)}")
    return list(types)


def _llama4(f: Fields) -> Shape:
    """Llama 4: NoPE full attention every `no_rope_layer_interval`-th layer, chunked local attention elsewhere.

    Chunked layers hold at most `attention_chunk_size` tokens. Query/key norms are weightless
    L2 norms. MoE layers (every `interleave_moe_layer_step`-th, or `moe_layers`) route to
    `num_local_experts` experts of `intermediate_size` beside one shared expert of the same
    width; the other layers keep a dense MLP of `intermediate_size_mlp`.
    """
    base = base_fields(f)
    layers = base["layers"]
    chunk = f.optional_size("attention_chunk_size")
    rope = f.config.get("no_rope_layers") or [int((i + 1) % f.size("no_rope_layer_interval") != 0)
                                               for i in range(layers)]
    if not isinstance(rope, list) or len(rope) < layers:
        raise PlanError(f"no_rope_layers must give one 0/1 entry for each of the {layers} layers")
    types = _layer_types(f, layers, lambda i: "chunked_attention" if rope[i] and chunk else "full_attention",
                         ("chunked_attention", "full_attention"))
    step = f.size("interleave_moe_layer_step")
    moe_layers = set(f.int_list("moe_layers")) if f.raw("moe_layers") is not None else set(range(step - 1, layers,
                                                                                                 step))
    width = f.size("intermediate_size")
    moe = MoE(f.size("num_local_experts"), f.size("num_experts_per_tok"), width, shared_intermediate=width,
              dense_layers=frozenset(set(range(layers)) - moe_layers))
    bias = f.flag("attention_bias")
    shape = Shape(**(base | dict(intermediate=f.size("intermediate_size_mlp"))), qkv_bias=bias, o_bias=bias, moe=moe)
    params = attention_params(shape)
    mixers = []
    for kind in types:
        if kind == "chunked_attention" and not chunk:
            raise PlanError("layer_types names chunked_attention but attention_chunk_size is null")
        window = chunk if kind == "chunked_attention" else None
        mixers.append(Mixer(LayerAttention(CHUNKED if window else FULL, shape.q_heads, shape.kv_heads, shape.head_dim,
                                           shape.head_dim, window=window), params))
    return replace(shape, mixers=tuple(mixers))


def _gemma4(f: Fields) -> Shape:
    """Gemma 4: sliding layers (`head_dim`, `num_key_value_heads`) and global layers with their own shape.

    Global layers use `global_head_dim` and, where `attention_k_eq_v` holds, the
    `num_global_key_value_heads` heads and no V projection: V is the key projection's
    output, normed but not rotated, and the cache stores it beside K as transformers and
    vLLM do. The last `num_kv_shared_layers` layers read earlier layers' caches and hold none.
    """
    base = base_fields(f)
    layers, hidden, heads = base["layers"], base["hidden"], base["q_heads"]
    types = _layer_types(f, layers, lambda i: "sliding_attention" if (i + 1) % 6 else "full_attention",
                         ("sliding_attention", "full_attention"))
    types[-1] = "full_attention"  # transformers forces the last layer global
    k_eq_v = f.flag("attention_k_eq_v")
    global_kv = (f.optional_size("num_global_key_value_heads") if k_eq_v else None) or base["kv_heads"]
    global_dim = f.size("global_head_dim")
    window = f.size("sliding_window")
    shared_from = layers - f.count("num_kv_shared_layers")
    if shared_from <= 0:
        raise PlanError(f"num_kv_shared_layers must leave at least one of the {layers} layers its own cache")
    per_layer_input = f.count("hidden_size_per_layer_input")
    double_wide = f.flag("use_double_wide_mlp")
    bias = 1 if f.flag("attention_bias") else 0
    moe = None
    extra = 2 * hidden * per_layer_input + hidden if per_layer_input else 0  # input gate, projection, norm
    if f.flag("enable_moe_block"):
        experts = f.size("num_experts")
        moe = MoE(experts, f.size("top_k_experts"), f.size("moe_intermediate_size"),
                  shared_intermediate=base["intermediate"])
        extra += hidden + experts + 3 * hidden  # router scale, per-expert scale, three more norms
    mixers = []
    for index, kind in enumerate(types):
        sliding = kind == "sliding_attention"
        kv, dim = (base["kv_heads"], base["head_dim"]) if sliding else (global_kv, global_dim)
        if heads % kv:
            raise PlanError(f"{kv} KV heads must divide the {heads} attention heads")
        shared = index >= shared_from
        projections = 0 if shared else (1 if k_eq_v and not sliding else 2)  # K, and V unless it is K
        params = (2 * hidden * heads * dim + projections * hidden * kv * dim + dim * (1 if shared else 2)
                  + bias * (heads * dim + projections * kv * dim + hidden))
        attention = LayerAttention(SLIDING if sliding else FULL, heads, kv, dim, dim,
                                   window=window if sliding else None, kv_shared=shared)
        width = 2 * base["intermediate"] if double_wide and shared else 0
        mixers.append(Mixer(attention, params, extra, width))
    ple = 0
    if per_layer_input:
        ple = layers * per_layer_input * (f.size("vocab_size_per_layer_input") + hidden) + per_layer_input
    sharing = layers - shared_from
    notes = (f"the last {sharing} layers share earlier layers' KV caches",) if sharing else ()
    return Shape(**base, norms_per_layer=4, moe=moe, mixers=tuple(mixers), extra_params=ple, notes=notes)


def _qwen3_next(f: Fields) -> Shape:
    """Qwen3-Next: full (gated-query) attention every `full_attention_interval`-th layer, Gated DeltaNet elsewhere.

    A linear-attention layer's cache is one state per sequence: the short convolution's last
    `linear_conv_kernel_dim - 1` inputs over q, k and v (what a decode step needs, as vLLM
    keeps it) plus the recurrent state of `linear_num_value_heads` x key dim x value dim.
    """
    base = base_fields(f)
    layers, hidden = base["layers"], base["hidden"]
    interval = f.config.get("full_attention_interval", 4)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
        raise PlanError(f"full_attention_interval must be a positive integer, got {interval!r}")
    types = _layer_types(f, layers, lambda i: "linear_attention" if (i + 1) % interval else "full_attention",
                         ("linear_attention", "full_attention"))
    k_heads, v_heads = f.size("linear_num_key_heads"), f.size("linear_num_value_heads")
    k_dim, v_dim = f.size("linear_key_head_dim"), f.size("linear_value_head_dim")
    kernel = f.size("linear_conv_kernel_dim")
    if v_heads % k_heads:
        raise PlanError(f"linear_num_value_heads {v_heads} must be a multiple of linear_num_key_heads {k_heads}")
    keys, values = k_heads * k_dim, v_heads * v_dim
    conv = 2 * keys + values
    linear_params = (hidden * (2 * keys + 2 * values) + hidden * 2 * v_heads + conv * kernel + 2 * v_heads + v_dim
                     + values * hidden)
    state = LayerAttention(STATE, v_heads, k_heads, k_dim, v_dim,
                           state_elements=conv * (kernel - 1) + v_heads * k_dim * v_dim)
    bias = f.flag("attention_bias")
    shape = Shape(**base, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=qwen_moe(f, shared=True))
    heads, kv, dim = shape.q_heads, shape.kv_heads, shape.head_dim
    full_params = attention_params(shape) + hidden * heads * dim + (heads * dim if bias else 0)  # the output gate
    full = LayerAttention(FULL, heads, kv, dim, dim)
    mixers = tuple(Mixer(full, full_params) if kind == "full_attention" else Mixer(state, linear_params)
                   for kind in types)
    return replace(shape, mixers=mixers)


LLAMA4_TEXT = dict(vocab_size=202048, intermediate_size=8192, intermediate_size_mlp=16384, num_attention_heads=40,
                   num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False,
                   num_experts_per_tok=1, num_local_experts=16, moe_layers=None, interleave_moe_layer_step=1,
                   no_rope_layers=None, no_rope_layer_interval=4, attention_chunk_size=8192, attention_bias=False)
GEMMA4_TEXT = dict(vocab_size=262144, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
                   sliding_window=512, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
                   attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
                   num_experts=None, top_k_experts=None, moe_intermediate_size=None, global_head_dim=512,
                   num_global_key_value_heads=None)
QWEN3_NEXT = dict(vocab_size=151936, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=False,
                  linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
                  num_experts=512, mlp_only_layers=None)

MIXED_FAMILIES: dict[str, Family] = {
    "llama4_text": Family(LLAMA4_TEXT, _llama4),
    "gemma4_text": Family(GEMMA4_TEXT, _gemma4),
    "qwen3_next": Family(QWEN3_NEXT, _qwen3_next),
}
