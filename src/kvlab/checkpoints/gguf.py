"""Llama- and Gemma 3-architecture GGUF files (llama.cpp's format) into a kvlab Decoder and Tokenizer.

How the quantised matrices are kept is the packing's choice: "dense" dequantises every
tensor once at load with `gguf.quants.dequantize` (transformers' arithmetic); "gguf" keeps
Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K blocks as planes kvlab's C kernels compute on
(kvlab.checkpoints.gguf_planes, not a weight changed) with int16 activations, and "gguf-a8"
the same with int8 activations on the 4-bit ones, as llama.cpp computes; "int4" hands 4-bit planes to
PyTorch's int4 kernel. Tensors a packing cannot hold are dequantised.

llama.cpp's converter stores each head's Q and K rows permuted so its adjacent-pair RoPE
computes what Hugging Face's rotate-half RoPE computes on the original rows. We undo the
permutation and use rotate-half everywhere, so GGUF and HF checkpoints share one layout.
(For a llama2.c model such as stories260K the "un-permuted" rows are a rotate-half
re-layout of its native interleaved rows: the same function, the same logits.) Gemma's
converter leaves the rows alone (llama.cpp runs it with NeoX, i.e. rotate-half, RoPE), and
stores its norms' multipliers (Hugging Face's 1 + w) directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from kvlab.checkpoints.tokenizer import Tokenizer, tokenizer_from_gguf
from kvlab.nn.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvlab.checkpoints.gguf_planes import BlockPlanes, packed_from_blocks, planes_from_blocks, stack_packed
from kvlab.nn.ggml import GROUP, PACKING_OF, Planes, ggml_layer, stack_planes
from kvlab.nn.kernels import kernels
from kvlab.nn.int4 import Int4Linear, int4_supported
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError
from kvlab.plan.gguf_file import TENSOR_TYPES, GGUFHeader, read_gguf_header
from kvlab.plan.gguf_header import GGUFMetadata, spec_from_gguf_header
from kvlab.plan.spec import FULL, SLIDING

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
ROPE_PERMUTED = ("llama",)  # architectures whose Q/K rows llama.cpp's converter permutes
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3, when the file states none


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the file stores it: `data` is a zero-copy numpy view of the mapped bytes
    (elements for float types, uint8 block rows for quantised ones, as gguf-py lays them out)."""

    name: str
    type_id: int  # ggml's tensor type (kvlab.plan.gguf_file.TENSOR_TYPES)
    shape: tuple[int, ...]  # GGUF order, innermost first
    data: np.ndarray
    n_bytes: int

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.type_id][0]

    @property
    def tensor_type(self) -> Any:
        """gguf-py's GGMLQuantizationType (imported only when asked: loading needs no gguf-py)."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id)


@dataclass
class GGUFFile:
    """Metadata (vocabulary included) and tensors of one file, read by kvlab.plan.gguf_file."""

    path: str
    header: GGUFHeader
    tensors: dict[str, StoredTensor]

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.metadata

    @property
    def weight_bytes(self) -> int:
        return self.header.weight_bytes


_ELEMENT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


def read_gguf(path: str) -> GGUFFile:
    """Parse the header with the planner's stdlib reader and map the tensors without copying them."""
    import mmap

    header = read_gguf_header(path, strings=True)
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)  # numpy's views keep it open
    tensors = {}
    for info in header.tensors.values():
        outer = info.rows_first_shape
        element = _ELEMENT_TYPES.get(info.type_name)
        if element is not None:
            data = np.frombuffer(mapped, element, info.n_elements, info.offset).reshape(outer)
        else:
            _, block, size = TENSOR_TYPES[info.type_id]
            data = np.frombuffer(mapped, np.uint8, info.n_bytes, info.offset).reshape(
                *outer[:-1], outer[-1] // block * size)
        tensors[info.name] = StoredTensor(info.name, info.type_id, info.dims, data, info.n_bytes)
    return GGUFFile(path, header, tensors)


def config_from_gguf(header: GGUFHeader) -> ModelConfig:
    """The Decoder config, from the planner's reading of the same header (kvlab.plan.gguf_header)
    plus the numbers the planner has no use for: MLP width, norm epsilon, RoPE bases, and
    Gemma 3's extras (kvlab.nn.config.ModelConfig says what each does)."""
    meta = GGUFMetadata(header.metadata)
    arch = meta.text("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise PlanError(f"unsupported GGUF architecture {arch!r}; kvlab runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    spec = spec_from_gguf_header(header)
    kinds = (FULL, SLIDING) if arch == "gemma3" else (FULL,)
    first = spec.layers[0]
    if len(spec.layers) != meta.size(f"{arch}.block_count") or any(
            layer.kind not in kinds or layer.k_head_dim != layer.v_head_dim or
            (layer.q_heads, layer.kv_heads, layer.k_head_dim) != (first.q_heads, first.kv_heads, first.k_head_dim)
            for layer in spec.layers):
        raise PlanError("kvlab runs GGUF models whose layers all have the same heads and "
                        + ("full or sliding attention" if arch == "gemma3" else "full attention"))
    head_dim = spec.head_dim
    if (meta.optional_size(f"{arch}.rope.dimension_count") or head_dim) != head_dim:
        raise PlanError("partial RoPE (rope.dimension_count < head dim) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and meta.number(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise PlanError(f"RoPE scaling ({scaling}) is not supported")
    if spec.vocab_size is None:
        raise PlanError(f"{header.path}: no token_embd.weight tensor; is this a language model?")
    extras: dict[str, Any] = {}
    if arch == "gemma3":
        windows = [layer.window if layer.kind == SLIDING else None for layer in spec.layers]
        extras = dict(mlp="geglu", qk_norm=True, post_norms=True, embed_scale=spec.hidden_size ** 0.5,
                      layer_types=[SLIDING_ATTENTION if w else FULL_ATTENTION for w in windows],
                      sliding_window=next((w for w in windows if w), 0),
                      rope_local_base=meta.number(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
    return ModelConfig(
        vocab_size=spec.vocab_size, dim=spec.hidden_size, n_layers=spec.num_layers, n_heads=spec.q_heads,
        n_kv_heads=spec.kv_heads, head_dim=head_dim, ffn_dim=meta.size(f"{arch}.feed_forward_length"),
        norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_base=meta.number(f"{arch}.rope.freq_base", 10000.0), max_seq_len=spec.max_context or 2048,
        tie_embeddings=spec.tied_embeddings,
        name=str(meta.get("general.basename") or meta.get("general.name") or "gguf-model"), **extras,
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


def dequantize(tensor: StoredTensor) -> torch.Tensor:
    """One stored tensor as fp32 [rows, cols] (GGUF lists dims innermost first).

    Float types and every block type kvlab.checkpoints.gguf_planes reads decode here with numpy
    (code x scale (+ offset), the arithmetic of gguf.quants.dequantize, bit for bit); other
    types go through gguf-py's own dequantiser.
    """
    shape = [int(n) for n in reversed(tensor.shape)]
    kind = tensor.type_name
    if kind in _ELEMENT_TYPES:  # astype copies: the tensor must not alias the read-only mapping
        return torch.from_numpy(np.asarray(tensor.data).astype(np.float32).reshape(shape))
    if len(shape) == 2:
        planes = planes_from_blocks(np.asarray(tensor.data).reshape(shape[0], -1), kind, shape[1])
        if planes is not None:
            return _dense(planes)
    from gguf import quants

    try:  # a plain ndarray view: numpy's memmap subclass costs seconds of bookkeeping per model here
        array = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError:
        raise PlanError(f"tensor {tensor.name}: quantisation {kind} is not supported") from None
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


def _dense(planes: Planes) -> torch.Tensor:
    """`planes.dense()` in numpy, in place: code x scale, then + offset, each rounded once, as
    gguf.quants computes them (without torch's temporaries, 113 MB each for SmolLM2's embedding)."""
    rows, cols = planes.codes.shape
    weights = planes.codes.numpy().astype(np.float32).reshape(rows, -1, GROUP[planes.kind])
    weights *= planes.scales.numpy()[..., None]
    if planes.offsets is not None:
        weights += planes.offsets.numpy()[..., None]
    return torch.from_numpy(weights.reshape(rows, cols))


# Each fused kvlab matrix and the GGUF tensors whose rows it stacks.
LAYER_MATRICES = {
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.o": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}
Q4_GROUP = 32
# Gemma 3's norms beyond Llama's two, kvlab name -> GGUF name (per block)
GEMMA_QK_NORMS = {"attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm"}
GEMMA_POST_NORMS = {"post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm"}


def _rows(name: str, config: ModelConfig, permuted: bool = True):
    """The row transform a GGUF matrix needs: Q and K rows un-permuted per head (when the file's
    architecture stores them permuted, ROPE_PERMUTED)."""
    if not permuted:
        return lambda t: t
    if name == "attn_q":
        return lambda t: unpermute_rope_rows(t, config.n_heads)
    if name == "attn_k":
        return lambda t: unpermute_rope_rows(t, config.kv_heads)
    return lambda t: t


def row_order(name: str, config: ModelConfig, rows: int, permuted: bool = True) -> Optional[np.ndarray]:
    """`_rows(name, config, permuted)` as row indices (None: rows as stored), from the same function."""
    if name not in ("attn_q", "attn_k") or not permuted:
        return None
    return _rows(name, config)(torch.arange(rows)[:, None])[:, 0].numpy()


PACKINGS = ("dense", "int4", *PACKING_OF.values())
ACTIVATIONS_OF = {packing: activations for activations, packing in PACKING_OF.items()}


def block_rows(tensor: StoredTensor) -> np.ndarray:
    """A quantised matrix's stored bytes as a view of the file, one row of blocks per output row: uint8 [rows, bytes]."""
    return np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)


def planes_of(tensor: StoredTensor) -> Optional[Planes]:
    """A quantised tensor as planes (kvlab.checkpoints.gguf_planes), None for other types."""
    if len(tensor.shape) != 2:
        return None
    return planes_from_blocks(block_rows(tensor), tensor.type_name, int(tensor.shape[0]))


def packed_of(tensor: StoredTensor) -> Optional[BlockPlanes]:
    """A quantised matrix in the kernels' layout, still views of the file where it can be; None for other types."""
    if len(tensor.shape) != 2:
        return None
    return packed_from_blocks(block_rows(tensor), tensor.type_name, int(tensor.shape[0]))


def packed_linear(parts: list[str], stored: list[StoredTensor], config: ModelConfig, packing: str,
                  permuted: bool = True) -> Optional[nn.Module]:
    """The layer that computes on `stored` (row-stacked) as the packing keeps it, or None to
    dequantise it: "gguf" and "gguf-a8" take any planes, "int4" 4-bit planes of one kind."""
    if packing not in (*ACTIVATIONS_OF, "int4") or (packing != "int4" and kernels() is None):
        return None
    if packing in ACTIVATIONS_OF:  # the file's blocks copied once into the kernels' layout (gguf_planes.stack_packed)
        blocks = [packed_of(t) for t in stored]
        if any(b is None for b in blocks):
            return None
        return ggml_layer([b.take_rows(row_order(name, config, b.rows, permuted)) for name, b in zip(parts, blocks)],
                          stack_packed, ACTIVATIONS_OF[packing])
    planes = [planes_of(t) for t in stored]
    if any(p is None for p in planes):
        return None
    planes = [p.map_rows(_rows(name, config, permuted)) for name, p in zip(parts, planes)]
    if len({p.kind for p in planes}) != 1:
        return None
    stacked = stack_planes(planes)
    rows, in_features = stacked.codes.shape
    if stacked.kind == "q4_1" and int4_supported(rows, in_features, Q4_GROUP):
        return Int4Linear.from_offset_codes(stacked.codes, stacked.scales, stacked.offsets, Q4_GROUP)
    return None


def load_weights(file: GGUFFile, config: ModelConfig, packing: str = "dense"
                 ) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module]]:
    """Dense tensors under Decoder names, plus packed modules for the layer matrices (and, with
    "gguf", the LM head) whose stored format the chosen packing computes on directly."""
    if packing not in PACKINGS:
        raise PlanError(f"unknown weight packing {packing!r}; expected one of {', '.join(PACKINGS)}")

    def tensor(name: str) -> Any:
        if name not in file.tensors:
            raise PlanError(f"GGUF file lacks tensor {name}")
        return file.tensors[name]

    permuted = file.meta.get("general.architecture") in ROPE_PERMUTED
    state = {"norm.weight": dequantize(tensor("output_norm.weight"))}
    modules: dict[str, nn.Module] = {}
    head = "token_embd" if config.tie_embeddings else "output"
    layer = packed_linear([head], [tensor(f"{head}.weight")], config, packing) if packing in ACTIVATIONS_OF else None
    if layer is not None:
        modules["lm_head"] = layer
    elif not config.tie_embeddings:
        state["lm_head.weight"] = dequantize(tensor("output.weight"))
    # A tied head packed from the embedding's own blocks decodes to the table in C (every planes
    # kind's code x scale (+ offset) is exact there, as gguf.quants computes it; tests check).
    tied = layer is not None and config.tie_embeddings
    state["embed.weight"] = layer.weight if tied else dequantize(tensor("token_embd.weight"))
    for i in range(config.n_layers):
        state[f"blocks.{i}.attn_norm.weight"] = dequantize(tensor(f"blk.{i}.attn_norm.weight"))
        state[f"blocks.{i}.mlp_norm.weight"] = dequantize(tensor(f"blk.{i}.ffn_norm.weight"))
        extra_norms = {**(GEMMA_QK_NORMS if config.qk_norm else {}), **(GEMMA_POST_NORMS if config.post_norms else {})}
        for ours, theirs in extra_norms.items():
            state[f"blocks.{i}.{ours}.weight"] = dequantize(tensor(f"blk.{i}.{theirs}.weight"))
        for ours, parts in LAYER_MATRICES.items():
            stored = [tensor(f"blk.{i}.{part}.weight") for part in parts]
            layer = packed_linear(list(parts), stored, config, packing, permuted)
            if layer is not None:
                modules[f"blocks.{i}.{ours}"] = layer
            else:
                state[f"blocks.{i}.{ours}.weight"] = torch.cat([_rows(p, config, permuted)(dequantize(t))
                                                               for p, t in zip(parts, stored)])
    return state, modules


def load_gguf(path: str, dtype: torch.dtype = torch.float32, packing: str = "dense"
              ) -> tuple[Decoder, Tokenizer, GGUFFile]:
    """Model (eval mode), tokenizer and the parsed file (for its metadata and bytes).

    `packing` says how matrices stored quantised are kept: "dense" dequantises everything into
    `dtype`; "gguf" keeps Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K blocks as planes and computes on them
    (GGMLLinear, on int16 activations: the dense model's greedy tokens), "gguf-a8" the same with
    int8 activations on the 4-bit ones as llama.cpp (the fastest); "int4" keeps 4-bit matrices (Q4_0/Q4_1/Q4_K) for
    PyTorch's int4 kernel (Int4Linear). Matrices a packing cannot hold are dequantised;
    activations, norms and the KV cache are in `dtype` either way.
    """
    file = read_gguf(path)
    if "token_embd.weight" not in file.tensors:
        raise PlanError(f"{path}: no token_embd.weight tensor; is this a language model?")
    config = config_from_gguf(file.header)
    state, modules = load_weights(file, config, packing)
    model = Decoder.from_state_dict(config, state, modules).to(dtype)
    return model.eval(), tokenizer_from_gguf(file.meta), file
