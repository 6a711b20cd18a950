"""Llama-architecture GGUF files (llama.cpp's format) into a kvlab Decoder and Tokenizer.

Quantised tensors (Q4_1, Q8_0, Q4_K, Q5_0, Q6_K, ...) are dequantised once at load with
`gguf.quants.dequantize` and kept in the compute dtype: at batch 1 on a CPU a dense bf16 or
fp32 matrix-vector product is faster than any dequantise-on-the-fly kernel torch offers.

llama.cpp's converter stores each head's Q and K rows permuted so its adjacent-pair RoPE
computes what Hugging Face's rotate-half RoPE computes on the original rows. We undo the
permutation and use rotate-half everywhere, so GGUF and HF checkpoints share one layout.
(For a llama2.c model such as stories260K the "un-permuted" rows are a rotate-half
re-layout of its native interleaved rows: the same function, the same logits.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlab.checkpoints.tokenizer import Tokenizer, tokenizer_from_gguf
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass
class GGUFFile:
    """Metadata and tensors of one file (tensors still in their stored types)."""

    path: str
    meta: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor

    @property
    def weight_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.tensors.values())


def read_gguf(path: str) -> GGUFFile:
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise PlanError(f"no such GGUF file: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as error:  # the reader raises ValueError/struct errors on a bad file
        raise PlanError(f"{path} is not a readable GGUF file: {error}") from None
    meta = {name: field.contents() for name, field in reader.fields.items()}
    return GGUFFile(path, meta, {t.name: t for t in reader.tensors})


def config_from_gguf(meta: dict[str, Any], vocab_size: int, tied: bool) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise PlanError(f"unsupported GGUF architecture {arch!r}; kvlab runs {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise PlanError(f"GGUF metadata lacks {arch}.{name}")
        return value

    dim, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", dim // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise PlanError("partial RoPE (rope.dimension_count < head dim) is not supported")
    return ModelConfig(
        vocab_size=vocab_size, dim=dim, n_layers=key("block_count"), n_heads=heads,
        n_kv_heads=key("attention.head_count_kv", heads), head_dim=head_dim, ffn_dim=key("feed_forward_length"),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)), rope_base=float(key("rope.freq_base", 10000.0)),
        max_seq_len=key("context_length", 2048), tie_embeddings=tied,
        name=str(meta.get("general.basename") or meta.get("general.name") or "gguf-model"),
    )


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head Q/K row permutation: reshape(h, 2, d/2) was stored as (h, d/2, 2)."""
    out_features, in_features = weight.shape
    return (weight.reshape(heads, out_features // heads // 2, 2, in_features)
            .transpose(1, 2).reshape(out_features, in_features))


def permute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permutation itself (rotate-half rows -> adjacent-pair rows), for tests and writers."""
    out_features, in_features = weight.shape
    return (weight.reshape(heads, 2, out_features // heads // 2, in_features)
            .transpose(1, 2).reshape(out_features, in_features))


def dequantize(tensor: Any) -> torch.Tensor:
    """One stored tensor as fp32 [rows, cols] (GGUF lists dims innermost first)."""
    from gguf import GGMLQuantizationType, quants

    shape = [int(n) for n in reversed(tensor.shape)]
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        array = np.asarray(tensor.data)
        if tensor.tensor_type == GGMLQuantizationType.BF16:
            array = quants.dequantize(array, tensor.tensor_type)
        return torch.from_numpy(array.astype(np.float32, copy=False).reshape(shape).copy())
    try:  # a plain ndarray view: numpy's memmap subclass costs seconds of bookkeeping per model here
        array = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError:
        raise PlanError(f"tensor {tensor.name}: quantisation {tensor.tensor_type.name} is not supported") from None
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


def state_dict_from_gguf(file: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    """GGUF tensor names -> Decoder parameter names, Q/K un-permuted, QKV and gate/up fused."""
    def get(name: str) -> torch.Tensor:
        if name not in file.tensors:
            raise PlanError(f"GGUF file lacks tensor {name}")
        return dequantize(file.tensors[name])

    state = {"embed.weight": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if not config.tie_embeddings:
        state["lm_head.weight"] = get("output.weight")
    for i in range(config.n_layers):
        blk, ours = f"blk.{i}.", f"blocks.{i}."
        q = unpermute_rope_rows(get(blk + "attn_q.weight"), config.n_heads)
        k = unpermute_rope_rows(get(blk + "attn_k.weight"), config.kv_heads)
        state[ours + "attn.qkv.weight"] = torch.cat((q, k, get(blk + "attn_v.weight")))
        state[ours + "attn.o.weight"] = get(blk + "attn_output.weight")
        state[ours + "mlp.gate_up.weight"] = torch.cat((get(blk + "ffn_gate.weight"), get(blk + "ffn_up.weight")))
        state[ours + "mlp.down.weight"] = get(blk + "ffn_down.weight")
        state[ours + "attn_norm.weight"] = get(blk + "attn_norm.weight")
        state[ours + "mlp_norm.weight"] = get(blk + "ffn_norm.weight")
    return state


def load_gguf(path: str, dtype: torch.dtype = torch.float32) -> tuple[Decoder, Tokenizer, GGUFFile]:
    """Model (in `dtype`, eval mode), tokenizer and the parsed file (for its metadata and bytes)."""
    file = read_gguf(path)
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise PlanError(f"{path}: no token_embd.weight tensor; is this a language model?")
    config = config_from_gguf(file.meta, int(embed.shape[1]), tied="output.weight" not in file.tensors)
    model = Decoder.from_state_dict(config, state_dict_from_gguf(file, config))
    return model.to(dtype).eval(), tokenizer_from_gguf(file.meta), file
