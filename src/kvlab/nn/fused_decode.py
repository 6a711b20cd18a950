"""A whole decode step in one C call, for Llama-family models held as GGUF blocks (planes).

On SmolLM2-135M a decode step is 121 matrix-vector products of a few hundred microseconds'
worth of arithmetic each; driven module by module from Python the calls, allocations and
thread start-ups around them cost more than the products. `FusedDecodeStep` hands the
model's weights, the cache's buffers and the RoPE tables to csrc/llama_decode.c once, and each
step is then one call. It computes what `Decoder.forward` computes with GGMLLinear layers
(the same activation codes, fp32 norms, RoPE, softmax and SwiGLU), writes K/V into the
kvlab.cache ContiguousCache the model would have used (fp32, fp16 or bf16 rows), and advances
its length, so the module path can take over at any step. `fused_step_for` says why not when it cannot apply.

The C side is the paged step (kvlab.nn.paged_decode) with one block of `capacity` tokens per
row; batch size and capacity are call arguments, and scratch memory is an arena kept by the
step object between calls.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Optional

import torch
from torch import nn

from kvlab.cache.contiguous import ContiguousCache
from kvlab.nn.c_abi import ACTIVATIONS, CACHE_DTYPES as C_CACHE_DTYPES, MAX_GROUP, MAX_LAYOUTS, KVPlane, \
    LlamaLayer, LlamaModel, QMatrix, QStack
from kvlab.nn.ggml import GGMLLinear, GGMLStack
from kvlab.nn.kernels import kernels
from kvlab.nn.model import Decoder
from kvlab.nn.rope import INTERLEAVED

# The ctypes mirrors live in kvlab.nn.c_abi, checked against the library's own table at load.
CACHE_DTYPES = {dtype: C_CACHE_DTYPES[dtype] for dtype in (torch.float32, torch.float16, torch.bfloat16)}


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
    if len({window for window in config.windows}) > MAX_LAYOUTS:
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


def why_not_fused(model: Decoder, cache) -> Optional[str]:
    """None when `FusedDecodeStep` can run `model` on `cache`, else the reason it cannot."""
    reason = why_not_model(model)
    if reason is not None:
        return reason
    config = model.config
    buffers = cache.float_buffers(0) if isinstance(cache, ContiguousCache) and not cache.pre_rope else None
    if buffers is None or buffers[0].dtype not in CACHE_DTYPES or buffers[0].dtype != buffers[1].dtype \
            or buffers[0].device.type != "cpu":
        return "the cache must be a contiguous fp32/fp16/bf16 CPU cache without pre-RoPE keys"
    if (cache.shape.num_layers, cache.shape.kv_heads, cache.shape.k_head_dim, cache.shape.v_head_dim) != \
            (config.n_layers, config.kv_heads, config.head_size, config.head_size):
        return "the cache was not built for this model's layers, KV heads and head dim"
    if len(set(cache.seq_len(layer) for layer in range(config.n_layers))) != 1:
        return "every layer of the cache must hold the same number of tokens"
    return None


class FusedDecodeStep:
    """`step(ids [B])` -> logits [B, vocab] for the token after those already in `cache`.

    Holds the addresses of the model's and the cache's tensors: build one per generation and
    do not move either (`.to()`, a new cache) while it is in use.
    """

    def __init__(self, model: Decoder, cache: ContiguousCache):
        reason = why_not_fused(model, cache)
        if reason is not None:
            raise ValueError(f"cannot fuse the decode step: {reason}")
        self.model, self.cache = model, cache
        sides = [tuple(KVPlane(t.data_ptr()) for t in cache.float_buffers(i)) for i in range(len(model.blocks))]
        self._struct, self._layers = llama_struct(model, sides, CACHE_DTYPES[cache.float_buffers(0)[0].dtype])
        self._arena = new_arena()
        weakref.finalize(self, kernels().kvlab_arena_free, self._arena)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        position = self.cache.seq_len(0)
        if position >= self.model.rope.max_seq_len:
            raise ValueError(f"position {position} is beyond the model's {self.model.rope.max_seq_len}-token context")
        x = embed_rows(self.model, ids.reshape(self.cache.shape.batch))
        logits = torch.empty(self.cache.shape.batch, self.model.config.vocab_size)
        status = kernels().llama_decode_step(ctypes.byref(self._struct), self.cache.shape.batch,
                                             self.cache.shape.max_tokens, position, x.data_ptr(), logits.data_ptr(),
                                             self._arena)
        if status == -2:
            raise ValueError(f"position {position} is beyond the cache's {self.cache.shape.max_tokens} tokens")
        if status:
            raise MemoryError("the fused decode step could not allocate its scratch buffers")
        self.cache.advance(1)
        return logits


def fused_step_for(model: Decoder, cache) -> Optional[FusedDecodeStep]:
    """The fused step for `model` on `cache`, or None where `why_not_fused` names a reason."""
    return FusedDecodeStep(model, cache) if why_not_fused(model, cache) is None else None
