"""The C step's model: a Decoder held as GGUF blocks (planes) described to csrc/llama_decode.c.

On SmolLM2-135M a decode step is 121 matrix-vector products of a few hundred microseconds'
worth of arithmetic each; driven module by module from Python the calls, allocations and
thread start-ups around them cost more than the products. The C step (kvlab.nn.paged_decode)
takes the model's weights, its pool's tensors and the RoPE tables once, as one descriptor per
layer (`llama_struct`), and computes what `Decoder.forward` computes with GGMLLinear layers
(the same activation codes, fp32 norms, RoPE, softmax and SwiGLU or GeGLU). `why_not_model`
says why not where it cannot apply.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import nn

from kvlab.nn.c_abi import ACTIVATIONS, MAX_GROUP, MAX_LAYOUTS, KVPlane, LlamaLayer, LlamaModel, QMatrix, QStack
from kvlab.nn.ggml import GGMLLinear, GGMLStack
from kvlab.nn.kernels import kernels
from kvlab.nn.model import Decoder
from kvlab.nn.rope import INTERLEAVED


def _qmatrix(layer: GGMLLinear) -> QMatrix:
    kind, codes, scales, offsets = layer.planes()
    return QMatrix(kind, layer.out_features, layer.in_features, codes, scales, offsets, *layer.interleaved())


def _qstack(layer: nn.Module) -> QStack:
    parts = list(layer.parts) if isinstance(layer, GGMLStack) else [layer]
    return QStack((QMatrix * 3)(*map(_qmatrix, parts)), len(parts))


def llama_struct(model: Decoder, sides: list[tuple[KVPlane, KVPlane]], cache_dtype: int,
                 group_size: int = 0, num_layers: Optional[int] = None,
                 layer_groups: Optional[list[tuple[int, Optional[int]]]] = None) -> tuple[LlamaModel, ctypes.Array]:
    """The C model for `model` (why_not_model is None) whose layer i keeps K/V in sides[i].

    `layer_groups[i]` is layer i's (KV group, window); by default one group and each layer's own
    window. `num_layers` keeps only the first layers, then the final norm and LM head (a
    self-draft). Returns the struct and its layer array, which must outlive every call that uses
    the struct.
    """
    config = model.config
    blocks = list(model.blocks)[:num_layers] if num_layers else list(model.blocks)
    layer_groups = layer_groups or [(0, config.window_of(i)) for i in range(len(blocks))]

    def weight(module) -> int:
        return module.weight.data_ptr() if module is not None else 0

    layers = (LlamaLayer * len(blocks))(*(
        LlamaLayer(block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr(),
                   weight(getattr(block.attn, "q_norm", None)), weight(getattr(block.attn, "k_norm", None)),
                   weight(getattr(block, "post_attn_norm", None)), weight(getattr(block, "post_mlp_norm", None)),
                   model.rope_for(i).cos.data_ptr(), model.rope_for(i).sin.data_ptr(), window or 0, group,
                   _qstack(block.attn.qkv), _qmatrix(block.attn.o), _qstack(block.mlp.gate_up),
                   _qmatrix(block.mlp.down), k, v)
        for i, (block, (k, v), (group, window)) in enumerate(zip(blocks, sides, layer_groups))))
    rope = model.rope
    struct = LlamaModel(len(blocks), config.dim, config.n_heads, config.kv_heads, config.head_size,
                        config.ffn_size, config.vocab_size, 1 + max(group for group, _ in layer_groups),
                        rope.max_seq_len, int(rope.style == INTERLEAVED), cache_dtype, group_size,
                        ACTIVATIONS[config.mlp], config.norm_eps, config.query_scale or 0.0, layers,
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
    if config.attention != "gqa" or config.mlp not in ACTIVATIONS or config.norm != "rmsnorm" or config.bias:
        return ("only bias-free Llama-family models (Llama, Gemma: RMSNorm, SwiGLU or GeGLU, grouped-query "
                "attention) run in C")
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
