"""ctypes mirrors of the C decode steps' structs and constants, and the check that they still match.

ctypes lays a Structure out from its `_fields_` alone: a field added, removed or retyped in
csrc/llama_decode.h but not here shifts every later field, and the C step then reads a
pointer where it expects an int, with no error. csrc/abi.c exports a table of the structs'
sizes, their fields' offsets and the shared constants; `abi_mismatches` compares it with
these mirrors, and kvlab.nn.kernels' loader refuses a library for which it finds any.

Nothing here imports the loader, so the loader can import this module.
"""

from __future__ import annotations

import ctypes
from typing import Mapping, Optional

import torch

_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float

# csrc/llama_decode.h's CACHE_*: the cache element formats the C steps read and write.
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
CACHE_INT8 = 5  # uint8 codes with fp16 scale and zero per group (kvlab.cache.codecs.GroupCodec, 8 bits)
CACHE_INT4, CACHE_INT2 = 6, 7  # the same with 4- and 2-bit codes packed into bytes as GroupCodec packs them
CACHE_GROUP_BITS = {8: CACHE_INT8, 4: CACHE_INT4, 2: CACHE_INT2}  # GroupCodec.bits -> CACHE_*
CACHE_KVQUANT = 8  # KVQuant rows, seats and codebooks (kvlab.cache.kvquant_pool), described by llama_model.kvq
CACHE_KIVI_BITS = {4: 9, 2: 10}  # KIVI pools (kvlab.cache.kivi_pool) by bits -> CACHE_KIVI4, CACHE_KIVI2
KIVI_MAX_GROUP = 256  # tokens (and channels) a KIVI group may hold in C
CHUNK = 128  # tokens per attention work unit
MAX_GROUP = 16  # query heads per KV head one pass over the cache serves

MAX_LAYOUTS = 4  # distinct attention windows a model may have (full attention is one)
PAGED_STEP_ARGS = 13  # llama_paged_step's parameters (kvlab.nn.kernels declares its argtypes from this)
PAGED_ATTEND_ARGS = 11  # llama_paged_attend's
ACTIVATIONS = {"swiglu": 0, "geglu": 1}  # csrc/llama_decode.h's ACT_*
ATTENTIONS = {"gqa": 0, "mla": 1}  # csrc/llama_decode.h's ATTN_* (kvlab.nn.config.ATTENTION_KINDS)

CONSTANTS = {"CACHE_F32": 0, "CACHE_F16": 1, "CACHE_BF16": 2, "CACHE_FP8_E4M3": 3, "CACHE_FP8_E5M2": 4,
             "CACHE_INT8": CACHE_INT8, "CACHE_INT4": CACHE_INT4, "CACHE_INT2": CACHE_INT2,
             "CACHE_KVQUANT": CACHE_KVQUANT, "CHUNK": CHUNK,
             "CACHE_KIVI4": CACHE_KIVI_BITS[4], "CACHE_KIVI2": CACHE_KIVI_BITS[2], "KIVI_MAX_GROUP": KIVI_MAX_GROUP,
             "MAX_GROUP": MAX_GROUP, "QK": 32, "MAX_LAYOUTS": MAX_LAYOUTS,
             "PAGED_STEP_ARGS": PAGED_STEP_ARGS, "PAGED_ATTEND_ARGS": PAGED_ATTEND_ARGS,
             "ACT_SWIGLU": ACTIVATIONS["swiglu"], "ACT_GEGLU": ACTIVATIONS["geglu"],
             "ATTN_GQA": ATTENTIONS["gqa"], "ATTN_MLA": ATTENTIONS["mla"]}


class QMatrix(ctypes.Structure):
    """ggml_gemv.h's qmatrix: one matrix as planes (kind, shape, codes, scales, offsets), and the
    same weights interleaved eight output rows at a time (codes8, d8, m8; NULL where absent)."""
    _fields_ = [("kind", _int), ("n", _int), ("k", _int), ("codes", _ptr), ("d", _ptr), ("m", _ptr),
                ("codes8", _ptr), ("d8", _ptr), ("m8", _ptr)]


class QActs(ctypes.Structure):
    """ggml_gemv.h's qacts: activations quantised per 32-value block (int16 codes and scales, exact
    sums, int8 codes, scales and sum errors), one array each."""
    _fields_ = [("q", _ptr), ("d", _ptr), ("s", _ptr), ("q8", _ptr), ("d8", _ptr), ("e8", _ptr)]


class QStack(ctypes.Structure):
    """ggml_gemv.h's qstack: up to three matrices whose outputs sit side by side."""
    _fields_ = [("part", QMatrix * 3), ("parts", _int)]


class KVPlane(ctypes.Structure):
    """llama_decode.h's kv_plane: one side (K or V) of one layer's cache (a KIVI pool's: its residual ring too)."""
    _fields_ = [("data", _ptr), ("scale", _ptr), ("zero", _ptr), ("fp8_scale", _ptr), ("ring", _ptr)]


class LlamaLayer(ctypes.Structure):
    """llama_decode.h's llama_layer: one layer's descriptor (norms, RoPE tables, window, KV group, matrices,
    cache; an MLA layer's attention kind, latent norm and up-projections; a window's sinks)."""
    _fields_ = [("attn_norm", _ptr), ("mlp_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("post_attn_norm", _ptr), ("post_mlp_norm", _ptr), ("rope_cos", _ptr), ("rope_sin", _ptr),
                ("window", _int), ("group", _int), ("qkv", QStack), ("o", QMatrix),
                ("gate_up", QStack), ("down", QMatrix), ("k", KVPlane), ("v", KVPlane),
                ("attention", _int), ("latent_norm", _ptr), ("w_uk", _ptr), ("w_uv", _ptr), ("sinks", _int)]


class LlamaModel(ctypes.Structure):
    _fields_ = [("n_layers", _int), ("dim", _int), ("n_heads", _int), ("n_kv_heads", _int), ("head_dim", _int),
                ("hidden", _int), ("vocab", _int), ("n_groups", _int), ("rope_len", _int),
                ("rope_interleaved", _int), ("cache_dtype", _int), ("group_size", _int), ("activation", _int),
                ("eps", _float), ("query_scale", _float), ("kv_lora_rank", _int), ("qk_nope_dim", _int),
                ("qk_rope_dim", _int), ("layers", ctypes.POINTER(LlamaLayer)), ("final_norm", _ptr),
                ("lm_head", QMatrix), ("kvq", _ptr), ("kivi_residual", _int),
                ("kivi_seats", _int), ("kivi_rows", _ptr)]


class KVQuantLayer(ctypes.Structure):
    """kvquant.h's kvquant_layer: one layer's KVQuant tensors (kvlab.cache.kvquant_pool.KVQuantPlanes)."""
    _fields_ = [(name, _ptr) for name in ("k_codes", "k_counts", "v_codes", "v_zero", "v_scale", "v_outliers",
                                          "v_outlier_index", "k_sink", "v_sink", "k_outliers", "k_outlier_index",
                                          "k_codebook", "v_codebook", "k_zero", "k_range")]


class KVQuantCache(ctypes.Structure):
    """kvquant.h's kvquant_cache: a KVQuant pool's shape, the step's seats (set before every call) and its layers."""
    _fields_ = [("bits", _int), ("outlier_percent", _int), ("sinks", _int), ("capacity", _int),
                ("v_outliers", _int), ("seats", _int), ("max_tokens", _int), ("rope_halves", _int), ("row_seats", _ptr),
                ("layers", ctypes.POINTER(KVQuantLayer))]


MIRRORS: dict[str, type[ctypes.Structure]] = {"qmatrix": QMatrix, "qacts": QActs, "qstack": QStack, "kv_plane": KVPlane,
                                              "llama_layer": LlamaLayer, "llama_model": LlamaModel,
                                              "kvquant_layer": KVQuantLayer, "kvquant_cache": KVQuantCache}


def abi_table(lib: ctypes.CDLL) -> dict[str, int]:
    """The library's exported table: struct sizes, "struct.field" offsets and constants."""
    lib.kvlab_abi_count.restype = ctypes.c_int
    lib.kvlab_abi_name.argtypes, lib.kvlab_abi_name.restype = [ctypes.c_int], ctypes.c_char_p
    lib.kvlab_abi_value.argtypes, lib.kvlab_abi_value.restype = [ctypes.c_int], ctypes.c_long
    return {lib.kvlab_abi_name(i).decode(): lib.kvlab_abi_value(i) for i in range(lib.kvlab_abi_count())}


def abi_mismatches(table: Mapping[str, int], mirrors: Optional[Mapping[str, type[ctypes.Structure]]] = None,
                   constants: Optional[Mapping[str, int]] = None) -> list[str]:
    """Every way `table` (abi_table's) disagrees with the mirrors and constants; empty when none.

    Each struct must have the same size, the same set of fields and each field the same
    offset on both sides; each constant must exist on both sides with one value.
    """
    mirrors = MIRRORS if mirrors is None else mirrors
    constants = CONSTANTS if constants is None else constants
    problems = []
    for name, mirror in mirrors.items():
        if name not in table:
            problems.append(f"struct {name} is mirrored in Python but not exported by the library")
            continue
        if ctypes.sizeof(mirror) != table[name]:
            problems.append(f"sizeof({name}) is {table[name]} in C, {ctypes.sizeof(mirror)} in {mirror.__name__}")
        c_fields = {key.split(".", 1)[1]: value for key, value in table.items() if key.startswith(name + ".")}
        py_fields = {field[0]: getattr(mirror, field[0]).offset for field in mirror._fields_}
        for field in sorted(c_fields.keys() - py_fields.keys()):
            problems.append(f"{name}.{field} is in C but missing from {mirror.__name__}")
        for field in sorted(py_fields.keys() - c_fields.keys()):
            problems.append(f"{mirror.__name__}.{field} is not a field of {name} in C")
        for field in sorted(c_fields.keys() & py_fields.keys()):
            if c_fields[field] != py_fields[field]:
                problems.append(f"offsetof({name}, {field}) is {c_fields[field]} in C, {py_fields[field]} in Python")
    structs = {key.split(".", 1)[0] for key in table if "." in key}
    for name in sorted(structs - mirrors.keys()):
        problems.append(f"struct {name} is exported by the library but has no Python mirror")
    exported = {key: value for key, value in table.items() if "." not in key and key not in structs}
    for name in sorted(exported.keys() | constants.keys()):
        if exported.get(name) != constants.get(name):
            problems.append(f"constant {name} is {exported.get(name)} in C, {constants.get(name)} in Python")
    return problems
