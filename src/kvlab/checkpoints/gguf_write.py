"""Write a Llama-architecture kvlab Decoder as a GGUF file llama.cpp loads.

The inverse of kvlab.checkpoints.gguf's reading: Q and K rows go back into llama.cpp's
adjacent-pair order (`permute_rope_rows`), the fused QKV and gate/up matrices are split into
llama.cpp's tensor names, and every tensor is stored as F32, so kvlab reading the file back
gets the very weights it wrote. The tokenizer is the source GGUF's own `tokenizer.*`
metadata, copied key by key: kvlab rebuilds its tokenizer from those keys, and so does
llama.cpp.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvlab.checkpoints.gguf import permute_rope_rows
from kvlab.checkpoints.hf import is_llama_family
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32


def write_gguf(model: Decoder, path: str, tokenizer_metadata: Optional[dict[str, Any]] = None) -> None:
    """`model` (dense, Llama family) to `path`; `tokenizer_metadata` holds the `tokenizer.*` keys."""
    import gguf

    config = model.config
    if not is_llama_family(config) or model.packing != "dense":
        raise PlanError("--gguf writes dense Llama-family models (GQA/MHA/MQA); this one is not")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(config.name)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.ffn_size)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_key_length(config.head_size)
    writer.add_value_length(config.head_size)
    writer.add_rope_dimension_count(config.head_size)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(ALL_F32)
    for key, value in (tokenizer_metadata or {}).items():
        _add_value(writer, key, value)
    for name, tensor in _tensors(model):
        writer.add_tensor(name, np.ascontiguousarray(tensor.detach().float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensors(model: Decoder):
    """(llama.cpp tensor name, fp32 tensor [rows, cols]) in llama.cpp's order."""
    c = model.config
    q, kv = c.n_heads * c.head_size, c.kv_heads * c.head_size
    yield "token_embd.weight", model.embed.weight
    yield "output_norm.weight", model.norm.weight
    if not c.tie_embeddings:
        yield "output.weight", model.lm_head.weight
    for i, block in enumerate(model.blocks):
        wq, wk, wv = block.attn.qkv.weight.split((q, kv, kv))
        gate, up = block.mlp.gate_up.weight.split(c.ffn_size)
        yield f"blk.{i}.attn_norm.weight", block.attn_norm.weight
        yield f"blk.{i}.attn_q.weight", permute_rope_rows(wq, c.n_heads)
        yield f"blk.{i}.attn_k.weight", permute_rope_rows(wk, c.kv_heads)
        yield f"blk.{i}.attn_v.weight", wv
        yield f"blk.{i}.attn_output.weight", block.attn.o.weight
        yield f"blk.{i}.ffn_norm.weight", block.mlp_norm.weight
        yield f"blk.{i}.ffn_gate.weight", gate
        yield f"blk.{i}.ffn_up.weight", up
        yield f"blk.{i}.ffn_down.weight", block.mlp.down.weight


def _add_value(writer: Any, key: str, value: Any) -> None:
    """One metadata value with the GGUF type llama.cpp expects for tokenizer keys."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        if value:
            writer.add_array(key, value)  # item type from the first item: str, int32 or float32
    else:
        raise PlanError(f"cannot write GGUF key {key} of type {type(value).__name__}")
