"""A whole decode step in one C call, for Llama-family models held as GGUF blocks (planes).

On SmolLM2-135M a decode step is 121 matrix-vector products of a few hundred microseconds'
worth of arithmetic each; driven module by module from Python the calls, allocations and
thread start-ups around them cost more than the products. `FusedDecodeStep` hands the
model's weights, the cache's buffers and the RoPE tables to csrc/llama_decode.c once, and each
step is then one call. It computes what `Decoder.forward` computes with GGMLLinear layers
(same int16 activations, same fp32 norms, RoPE, softmax and SwiGLU), writes K/V into the
kvlab.cache ContiguousCache the model would have used (fp32, fp16 or bf16 rows), and advances
its length, so the module path can take over at any step. `fused_step_for` says why not when it cannot apply.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import nn

from kvlab.cache.contiguous import ContiguousCache
from kvlab.nn.ggml import GGMLLinear, GGMLStack, kernels
from kvlab.nn.model import Decoder
from kvlab.nn.rope import INTERLEAVED

_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # llama_decode.c's CACHE_*
MAX_GROUP = 16  # llama_decode.c's MAX_GROUP

# These mirror the structs of csrc/ggml_gemv.h and csrc/llama_decode.c field for field.

class QMatrix(ctypes.Structure):
    _fields_ = [("kind", _int), ("n", _int), ("k", _int), ("codes", _ptr), ("d", _ptr), ("m", _ptr)]


class QStack(ctypes.Structure):
    _fields_ = [("part", QMatrix * 3), ("parts", _int)]


class LlamaLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _ptr), ("mlp_norm", _ptr), ("qkv", QStack), ("o", QMatrix),
                ("gate_up", QStack), ("down", QMatrix), ("k_cache", _ptr), ("v_cache", _ptr)]


class LlamaModel(ctypes.Structure):
    _fields_ = [("n_layers", _int), ("dim", _int), ("n_heads", _int), ("n_kv_heads", _int), ("head_dim", _int),
                ("hidden", _int), ("vocab", _int), ("batch", _int), ("capacity", _int),
                ("rope_interleaved", _int), ("cache_dtype", _int), ("eps", _float), ("rope_cos", _ptr),
                ("rope_sin", _ptr),
                ("layers", ctypes.POINTER(LlamaLayer)), ("final_norm", _ptr), ("lm_head", QMatrix)]


def _qmatrix(layer: GGMLLinear) -> QMatrix:
    kind, codes, scales, offsets = layer.planes()
    return QMatrix(kind, layer.out_features, layer.in_features, codes, scales, offsets)


def _qstack(layer: nn.Module) -> QStack:
    parts = list(layer.parts) if isinstance(layer, GGMLStack) else [layer]
    return QStack((QMatrix * 3)(*map(_qmatrix, parts)), len(parts))


def why_not_fused(model: Decoder, cache) -> Optional[str]:
    """None when `FusedDecodeStep` can run `model` on `cache`, else the reason it cannot."""
    config = model.config
    if kernels() is None:
        return "the GGML kernels are unavailable on this machine"
    if config.attention != "gqa" or config.mlp != "swiglu" or config.norm != "rmsnorm" or config.bias:
        return "only bias-free Llama-family models (RMSNorm, SwiGLU, grouped-query attention) are fused"
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
        config, self.model, self.cache = model.config, model, cache
        layers = []
        for index, block in enumerate(model.blocks):
            k, v = cache.float_buffers(index)
            layers.append(LlamaLayer(block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr(),
                                     _qstack(block.attn.qkv), _qmatrix(block.attn.o), _qstack(block.mlp.gate_up),
                                     _qmatrix(block.mlp.down), k.data_ptr(), v.data_ptr()))
        self._layers = (LlamaLayer * len(layers))(*layers)
        rope = model.rope
        self._struct = LlamaModel(config.n_layers, config.dim, config.n_heads, config.kv_heads, config.head_size,
                                  config.ffn_size, config.vocab_size, cache.shape.batch, cache.shape.max_tokens,
                                  int(rope.style == INTERLEAVED), CACHE_DTYPES[cache.float_buffers(0)[0].dtype],
                                  config.norm_eps, rope.cos.data_ptr(), rope.sin.data_ptr(), self._layers,
                                  model.norm.weight.data_ptr(), _qmatrix(model.lm_head))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        position = self.cache.seq_len(0)
        if position >= self.model.rope.max_seq_len:
            raise ValueError(f"position {position} is beyond the model's {self.model.rope.max_seq_len}-token context")
        x = self.model.embed(ids.reshape(self.cache.shape.batch)).float().contiguous()
        logits = torch.empty(self.cache.shape.batch, self.model.config.vocab_size)
        status = kernels().llama_decode_step(ctypes.byref(self._struct), position, x.data_ptr(), logits.data_ptr())
        if status == -2:
            raise ValueError(f"position {position} is beyond the cache's {self.cache.shape.max_tokens} tokens")
        if status:
            raise MemoryError("the fused decode step could not allocate its scratch buffers")
        self.cache.advance(1)
        return logits


def fused_step_for(model: Decoder, cache) -> Optional[FusedDecodeStep]:
    """The fused step for `model` on `cache`, or None where `why_not_fused` names a reason."""
    return FusedDecodeStep(model, cache) if why_not_fused(model, cache) is None else None
