"""The C step's model: a Decoder held as GGUF blocks (planes) described to csrc/llama_decode.c.

On SmolLM2-135M a decode step is 121 matrix-vector products of a few hundred microseconds'
worth of arithmetic each; driven module by module from Python the calls, allocations and
thread start-ups around them cost more than the products. The C step (kvlab.nn.paged_decode)
takes the model's weights, its pool's tensors and the RoPE tables once, as one descriptor per
layer (`llama_struct`), and computes what `Decoder.forward` computes with GGMLLinear layers
(the same activation codes, fp32 norms, RoPE, softmax and SwiGLU or GeGLU). `why_not_model`
says why not where it cannot apply.

An MLA model (kvlab.nn.mla, a `kvlab convert --to mla` directory loaded with `--weights q8_0`)
is described the same way, each layer with attention kind ATTN_MLA: its query and latent
projections stacked as the layer's qkv, its latent norm, and its up-projection split into W_uk
and W_uv as fp32 matrices (csrc/mla_attend.h decodes absorbed, as `MLA.absorbed` does).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import nn

from kvlab.nn.c_abi import (ACTIVATIONS, ATTENTIONS, MAX_GROUP, MAX_LAYOUTS, KVPlane, LlamaLayer, LlamaModel, QMatrix,
                            QStack)
from kvlab.nn.ggml import GGMLLinear, GGMLStack
from kvlab.nn.kernels import kernels
from kvlab.nn.model import Decoder
from kvlab.nn.rope import INTERLEAVED


def _qmatrix(layer: GGMLLinear) -> QMatrix:
    kind, codes, scales, offsets = layer.planes()
    return QMatrix(kind, layer.out_features, layer.in_features, codes, scales, offsets, *layer.interleaved())


def _parts(layer: nn.Module) -> list[GGMLLinear]:
    return list(layer.parts) if isinstance(layer, GGMLStack) else [layer]


def _qstack(*layers: nn.Module) -> QStack:
    """The layers' parts stacked (an MLA layer's query rows, then its latent rows)."""
    parts = [part for layer in layers for part in _parts(layer)]
    return QStack((QMatrix * 3)(*map(_qmatrix, parts)), len(parts))


def mla_up_weights(block) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """An MLA block's W_uk [heads, nope, rank] (None when nope is 0) and W_uv [heads, v, rank], fp32 and
    contiguous: the up-projection's values the module path's `up_weights` reads."""
    w_uk, w_uv = block.attn.up_weights()
    keys = w_uk.detach().float().contiguous() if w_uk.shape[1] else None
    return keys, w_uv.detach().float().contiguous()


def _attention(block, up: Optional[tuple]) -> tuple:
    """A layer's attention fields: (qkv, kind, latent norm, W_uk, W_uv); `up` is mla_up_weights' pair."""
    if up is None:
        return _qstack(block.attn.qkv), ATTENTIONS["gqa"], 0, 0, 0
    norm = block.attn.kv_norm.weight.data_ptr() if hasattr(block.attn.kv_norm, "weight") else 0
    keys, values = up
    return (_qstack(block.attn.wq, block.attn.wkv_a), ATTENTIONS["mla"], norm,
            keys.data_ptr() if keys is not None else 0, values.data_ptr())


def llama_struct(model: Decoder, sides: list[tuple[KVPlane, KVPlane]], cache_dtype: int,
                 group_size: int = 0, num_layers: Optional[int] = None,
                 layer_groups: Optional[list[tuple[int, Optional[int], int]]] = None) -> tuple[LlamaModel, ctypes.Array]:
    """The C model for `model` (why_not_model is None) whose layer i keeps K/V in sides[i].

    `layer_groups[i]` is layer i's (KV group, window, sinks); by default one group and each layer's own
    window, without sinks. `num_layers` keeps only the first layers, then the final norm and LM head (a
    self-draft). `up_weights[i]` is MLA layer i's (W_uk, W_uv) (mla_up_weights; made here when
    not given). Returns the struct and its layer array, which must outlive every call that uses
    the struct, as must the up-weights (the array holds them as `_keep`).
    """
    config = model.config
    blocks = list(model.blocks)[:num_layers] if num_layers else list(model.blocks)
    layer_groups = layer_groups or [(0, config.window_of(i), 0) for i in range(len(blocks))]
    mla = config.attention == "mla"
    ups = [mla_up_weights(block) if mla else None for block in blocks]

    def weight(module) -> int:
        return module.weight.data_ptr() if module is not None else 0

    layers = (LlamaLayer * len(blocks))(*(
        LlamaLayer(block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr(),
                   weight(getattr(block.attn, "q_norm", None)), weight(getattr(block.attn, "k_norm", None)),
                   weight(getattr(block, "post_attn_norm", None)), weight(getattr(block, "post_mlp_norm", None)),
                   model.rope_for(i).cos.data_ptr(), model.rope_for(i).sin.data_ptr(), window or 0, group,
                   qkv, _qmatrix(block.attn.o), _qstack(block.mlp.gate_up), _qmatrix(block.mlp.down), k, v,
                   kind, latent_norm, w_uk, w_uv, sinks)
        for i, (block, (k, v), (group, window, sinks), up) in enumerate(zip(blocks, sides, layer_groups, ups))
        for qkv, kind, latent_norm, w_uk, w_uv in [_attention(block, up)]))
    layers._keep = ups
    rope = model.rope
    if mla:  # RoPE keys stand where KV heads do; the output projection reads v_head_dim per head
        heads, head_dim = config.rope_key_heads, config.v_head_dim
        query_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5  # kvlab.nn.mla.MLA.scale
        latent = (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim)
    else:
        heads, head_dim, query_scale, latent = config.kv_heads, config.head_size, config.query_scale or 0.0, (0, 0, 0)
    struct = LlamaModel(len(blocks), config.dim, config.n_heads, heads, head_dim,
                        config.ffn_size, config.vocab_size, 1 + max(group for group, _, _ in layer_groups),
                        rope.max_seq_len, int(rope.style == INTERLEAVED), cache_dtype, group_size,
                        ACTIVATIONS[config.mlp], config.norm_eps, query_scale, *latent, layers,
                        model.norm.weight.data_ptr(), _qmatrix(model.lm_head))
    return struct, layers


def embed_rows(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    """The C step's input rows: the tokens' embeddings, scaled as the model's forward scales them
    (Gemma: by sqrt(dim), rounded to the dtype first), fp32 and contiguous."""
    x = model.embed(ids)
    if model.config.embed_scale != 1.0:
        x = x * torch.tensor(model.config.embed_scale, dtype=x.dtype)
    return x.float().contiguous()


def new_arena() -> int:
    """A C scratch arena (csrc/llama_decode.h), freed with the object that holds it: callers do
    `self._arena = new_arena()` and `weakref.finalize(self, kernels().kvlab_arena_free, self._arena)`."""
    arena = kernels().kvlab_arena_new()
    if not arena:
        raise MemoryError("could not allocate the decode step's scratch arena")
    return arena


def why_not_model(model: Decoder) -> Optional[str]:
    """None when the C decode steps can run `model` (whatever its cache), else the reason they cannot."""
    config = model.config
    if kernels() is None:
        return "the GGML kernels are unavailable on this machine"
    if config.attention not in ATTENTIONS or config.mlp not in ACTIVATIONS or config.norm != "rmsnorm" or config.bias:
        return ("only bias-free Llama-family models (Llama, Gemma, MLA conversions: RMSNorm, SwiGLU or GeGLU, "
                "grouped-query or latent attention) run in C")
    if config.attention == "mla":
        return _why_not_mla(model)
    if len({window for window in config.sliding_windows}) > MAX_LAYOUTS:
        return f"the C step runs at most {MAX_LAYOUTS} distinct attention windows"
    if model.dtype != torch.float32:
        return "the fused step computes in fp32"
    single = [model.lm_head] + [m for block in model.blocks for m in (block.attn.o, block.mlp.down)]
    stacked = [m for block in model.blocks for m in (block.attn.qkv, block.mlp.gate_up)]
    if not all(isinstance(layer, GGMLLinear) for layer in single) or \
            not all(isinstance(layer, (GGMLLinear, GGMLStack)) and len(getattr(layer, "parts", [0])) <= 3
                    for layer in stacked):
        return "every matrix must be held as GGUF blocks kvlab computes on (load with weights='gguf')"
    q_width, dim, ffn = config.n_heads * config.head_size, config.dim, config.ffn_size
    shapes = {"attn.qkv": (q_width + 2 * config.kv_heads * config.head_size, dim), "attn.o": (dim, q_width),
              "mlp.gate_up": (2 * ffn, dim), "mlp.down": (dim, ffn)}
    layers = [(block.get_submodule(name), shape) for block in model.blocks for name, shape in shapes.items()]
    if any((layer.out_features, layer.in_features) != shape
           for layer, shape in layers + [(model.lm_head, (config.vocab_size, dim))]):
        return "the matrices' shapes do not match the config"
    if config.head_size % 8 or config.n_heads // config.kv_heads > MAX_GROUP:
        return f"the head dim must be a multiple of 8, with at most {MAX_GROUP} query heads per KV head"
    return None


def _why_not_mla(model: Decoder) -> Optional[str]:
    """why_not_model for an MLA model (kvlab.nn.mla): its matrices as blocks, widths the C step's loops take."""
    config = model.config
    if any(config.sliding_windows):
        return "the C step's MLA layers attend fully"
    if model.dtype != torch.float32:
        return "the fused step computes in fp32"
    single = [model.lm_head] + [m for block in model.blocks for m in (block.attn.o, block.mlp.down)]
    stacked = [m for block in model.blocks for m in (block.attn.wq, block.attn.wkv_a, block.mlp.gate_up)]
    if not all(isinstance(layer, GGMLLinear) for layer in single) or \
            not all(isinstance(layer, (GGMLLinear, GGMLStack)) for layer in stacked) or \
            any(len(_parts(block.attn.wq)) + len(_parts(block.attn.wkv_a)) > 3 for block in model.blocks):
        return ("every projection must be held as GGUF blocks kvlab computes on (a converted directory: load it "
                "with weights='q8_0')")
    rank, nope, rope, dv = config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    heads, dim, ffn = config.n_heads, config.dim, config.ffn_size
    shapes = {"attn.wq": (heads * (nope + rope), dim), "attn.wkv_a": (rank + config.rope_key_heads * rope, dim),
              "attn.o": (dim, heads * dv), "mlp.gate_up": (2 * ffn, dim), "mlp.down": (dim, ffn)}
    layers = [(block.get_submodule(name), shape) for block in model.blocks for name, shape in shapes.items()]
    if any((layer.out_features, layer.in_features) != shape
           for layer, shape in layers + [(model.lm_head, (config.vocab_size, dim))]):
        return "the matrices' shapes do not match the config"
    if rank % 8 or rope % 8 or dv % 8 or heads // config.rope_key_heads > MAX_GROUP:
        return (f"the C step's MLA needs a latent rank, RoPE width and value head dim that are multiples of 8 "
                f"(got {rank}, {rope}, {dv}), with at most {MAX_GROUP} query heads per RoPE key")
    return None
