"""Write a Llama- or Gemma 3-architecture kvlab Decoder as a GGUF file llama.cpp loads.

The inverse of kvlab.checkpoints.gguf's reading: for `llama`, Q and K rows go back into
llama.cpp's adjacent-pair order (`permute_rope_rows`); for `gemma3` they stay as they are
(llama.cpp rotates Gemma's halves, NeoX style) and the norms are stored as the multipliers
themselves, as llama.cpp's converter stores Gemma's 1 + w. The fused QKV and gate/up matrices
are split into llama.cpp's tensor names, and every tensor is stored as F32, so kvlab reading
the file back gets the very weights it wrote.

llama.cpp builds gemma3's layer pattern and sliding-layer RoPE base into the architecture
(every 6th layer global, base 10,000) and scales queries by head_dim ** -0.5 (below 27B), so a
Gemma model that differs in any of these is refused rather than written to compute another
function. The tokenizer is the source GGUF's own `tokenizer.*`
metadata, copied key by key: kvlab rebuilds its tokenizer from those keys, and so does
llama.cpp.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvlab.checkpoints.gguf import GEMMA3_LOCAL_ROPE_BASE, GEMMA_POST_NORMS, GEMMA_QK_NORMS, permute_rope_rows
from kvlab.checkpoints.hf import is_llama_family
from kvlab.checkpoints.hf_gemma import is_gemma3_family
from kvlab.nn.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32
GEMMA3_SWA_PERIOD = 6  # llama.cpp's set_swa_pattern(6) for gemma3: layer i is global when i % 6 == 5


def write_gguf(model: Decoder, path: str, tokenizer_metadata: Optional[dict[str, Any]] = None) -> None:
    """`model` (dense, Llama family) to `path`; `tokenizer_metadata` holds the `tokenizer.*` keys."""
    import gguf

    config = model.config
    if model.packing != "dense":
        raise PlanError(f"--gguf writes dense weights, not {model.packing}")
    gemma = is_gemma3_family(config)
    if gemma:
        check_gemma3_for_llama_cpp(config)
    elif not is_llama_family(config):
        raise PlanError("--gguf writes dense Llama-family (GQA/MHA/MQA) and Gemma 3 models; this one is neither")
    writer = gguf.GGUFWriter(path, "gemma3" if gemma else "llama")
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
    if gemma and config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_freq_base_swa(config.rope_local_base or config.rope_base)
    for key, value in (tokenizer_metadata or {}).items():
        _add_value(writer, key, value)
    for name, tensor in _tensors(model, gemma):
        writer.add_tensor(name, np.ascontiguousarray(tensor.detach().float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensors(model: Decoder, gemma: bool = False):
    """(llama.cpp tensor name, fp32 tensor [rows, cols]) in llama.cpp's order. Llama's Q/K rows are
    permuted for llama.cpp's RoPE; Gemma 3's stay as they are and bring its q/k and post norms."""
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
        yield f"blk.{i}.attn_q.weight", wq if gemma else permute_rope_rows(wq, c.n_heads)
        yield f"blk.{i}.attn_k.weight", wk if gemma else permute_rope_rows(wk, c.kv_heads)
        yield f"blk.{i}.attn_v.weight", wv
        if gemma:
            for ours, theirs in {**GEMMA_QK_NORMS, **GEMMA_POST_NORMS}.items():
                yield f"blk.{i}.{theirs}.weight", block.get_submodule(ours).weight
        yield f"blk.{i}.attn_output.weight", block.attn.o.weight
        yield f"blk.{i}.ffn_norm.weight", block.mlp_norm.weight
        yield f"blk.{i}.ffn_gate.weight", gate
        yield f"blk.{i}.ffn_up.weight", up
        yield f"blk.{i}.ffn_down.weight", block.mlp.down.weight


def check_gemma3_for_llama_cpp(config: ModelConfig) -> None:
    """A one-line PlanError for a Gemma 3 model llama.cpp's gemma3 graph would compute differently."""
    if not config.sliding_window:
        raise PlanError("--gguf: llama.cpp's gemma3 always slides 5 of every 6 layers; this model has no window")
    expected = tuple(SLIDING_ATTENTION if i % GEMMA3_SWA_PERIOD < GEMMA3_SWA_PERIOD - 1 else FULL_ATTENTION
                     for i in range(config.n_layers))
    if tuple(config.layer_types or ()) != expected:
        raise PlanError("--gguf: llama.cpp's gemma3 makes every 6th layer global and the others sliding; "
                        "this model's layer_types differ")
    local = config.rope_local_base or config.rope_base
    if local != GEMMA3_LOCAL_ROPE_BASE:
        raise PlanError(f"--gguf: llama.cpp's gemma3 rotates sliding layers with base {GEMMA3_LOCAL_ROPE_BASE:g}; "
                        f"this model uses {local:g}")
    if config.query_scale not in (None, config.head_size ** -0.5):
        raise PlanError("--gguf: llama.cpp's gemma3 scales queries by head_dim ** -0.5; this model does not")


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
