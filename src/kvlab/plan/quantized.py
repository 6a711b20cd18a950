"""Weights as the checkpoint ships them: a config.json's `quantization_config`, counted tensor by tensor.

A quantised checkpoint stores each converted linear layer's matrix in a narrow format plus its
scales, and keeps every other tensor (embeddings, norms, biases, routers, and the modules the
config excludes) in the model dtype. The byte counts below are the tensors each format writes:

- `mxfp4` (gpt-oss): the MoE experts as 4-bit blocks plus one E8M0 byte per 32 values
  (4.25 bits); `modules_to_not_convert` (attention, router, embeddings, LM head) kept.
- `fp8` with `weight_block_size` [128, 128] (DeepSeek-V3): one byte per weight plus one fp32
  `weight_scale_inv` per 128 x 128 block; without a block size, one fp32 scale per matrix.
- `awq`: `bits`-wide codes, an fp16 scale and a `bits`-wide zero point per `group_size` input
  columns of each output row.
- `gptq`: the same, plus an int32 `g_idx` per input column (AutoGPTQ always writes it).
- `compressed-tensors`: per `config_groups` entry, its weights' `num_bits`, `type`, `strategy`
  (tensor, channel, group, block) and symmetry; NVFP4 (4 bits, an fp8 scale per 16 values and
  two fp32 global scales) and MXFP4 included; `ignore` honoured.
- `bitsandbytes`: NF4/FP4 codes with an absmax per 64 values (one byte with double quantisation,
  plus one fp32 per 256 of them), or int8 with one fp32 scale per row.

Exclusion patterns are matched as their libraries match them: "re:REGEX" by regular
expression, a dotted name as that module or anything under it, `*` as any run of characters.
DeepSeek's multi-token-prediction layer ships in the checkpoint but is loaded only for MTP
speculative decoding, so it is counted in `checkpoint_bytes`, not in the loaded `bytes`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.hf_shape import Shape
from kvlab.plan.linear_layers import Linear, linear_layers

FP32, FP16 = 4, 2


@dataclass(frozen=True)
class StoredWeights:
    """A quantised checkpoint's bytes: loaded by an engine, and shipped (MTP layers included)."""

    bytes: int
    checkpoint_bytes: int
    label: str
    quantized_params: int


@dataclass(frozen=True)
class _Scheme:
    label: str
    converts: Callable[[Linear], bool]  # whether this format converts the linear (before exclusions)
    stored: Callable[[Linear], int]  # bytes of one converted linear entry (all its matrices)
    excluded: tuple[str, ...]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def model_dtype_bytes(config: dict) -> int:
    """Bytes per value of the tensors a quantiser keeps: the config's `torch_dtype` (bf16 when unstated)."""
    dtype = config.get("torch_dtype", config.get("dtype")) or "bfloat16"
    return FP32 if str(dtype).replace("torch.", "") in ("float32", "float") else FP16


def matches(name: str, pattern: str) -> bool:
    """Whether module `name` is `pattern` or lies under it ("re:" patterns are regular expressions)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(rf"(.*\.)?{regex}(\..*)?", name) is not None


def _excluded(name: str, patterns: Iterable[str]) -> bool:
    return any(matches(name, pattern) for pattern in patterns)


def _patterns(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise PlanError(f"quantization_config.{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _int(qc: dict, key: str, default: Optional[int] = None) -> int:
    value = qc.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(f"quantization_config.{key} must be an integer, got {value!r}")
    return value


def _layer_linear(linear: Linear) -> bool:
    return linear.name != "lm_head" and not linear.router


def _mxfp4(qc: dict) -> _Scheme:
    def stored(linear: Linear) -> int:
        return linear.count * linear.rows * (_cdiv(linear.cols, 2) + _cdiv(linear.cols, 32))

    return _Scheme("mxfp4 (4-bit E2M1, an E8M0 scale per 32)", lambda linear: ".experts." in linear.name + ".",
                   stored, _patterns(qc.get("modules_to_not_convert"), "modules_to_not_convert"))


def _fp8(qc: dict) -> _Scheme:
    block = qc.get("weight_block_size")
    static = qc.get("activation_scheme") == "static"
    if block is not None and (not isinstance(block, list) or len(block) != 2 or
                              not all(isinstance(b, int) and b > 0 for b in block)):
        raise PlanError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")

    def stored(linear: Linear) -> int:
        scales = _cdiv(linear.rows, block[0]) * _cdiv(linear.cols, block[1]) if block else 1
        return linear.count * (linear.rows * linear.cols + FP32 * scales + (FP32 if static else 0))

    label = f"fp8 e4m3, fp32 scale per {block[0]}x{block[1]} block" if block else "fp8 e4m3, one scale per matrix"
    excluded = _patterns(qc.get("modules_to_not_convert"), "modules_to_not_convert") + \
        _patterns(qc.get("ignored_layers"), "ignored_layers")
    return _Scheme(label, _layer_linear, stored, excluded)


def _grouped(qc: dict, method: str) -> _Scheme:
    bits = _int(qc, "bits", 4)
    if bits not in (2, 3, 4, 8):
        raise PlanError(f"quantization_config.bits must be 2, 3, 4 or 8 for {method}, got {bits}")
    group = _int(qc, "group_size", 128)

    def stored(linear: Linear) -> int:
        groups = _cdiv(linear.cols, group) if group > 0 else 1
        codes = _cdiv(linear.rows * linear.cols * bits, 8)
        per_group = groups * linear.rows * FP16 + _cdiv(groups * linear.rows * bits, 8)  # scales, packed zeros
        g_idx = linear.cols * FP32 if method == "gptq" else 0
        return linear.count * (codes + per_group + g_idx)

    converts = (lambda linear: not linear.router) if qc.get("lm_head") else _layer_linear
    label = f"{method} int{bits}, group {group if group > 0 else 'per row'}"
    excluded = _patterns(qc.get("modules_to_not_convert"), "modules_to_not_convert")
    return _Scheme(label, converts, stored, excluded)


def _compressed_tensors(qc: dict) -> _Scheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise PlanError("quantization_config.config_groups must describe at least one group")
    entries = []
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise PlanError(f"quantization_config.config_groups.{name}.weights must be an object")
        targets = _patterns(group.get("targets", ["Linear"]), f"config_groups.{name}.targets")
        static_input = isinstance(group.get("input_activations"), dict) and \
            group["input_activations"].get("dynamic") is False
        entries.append((targets, weights, group.get("format") or qc.get("format") or "", static_input))

    def group_of(linear: Linear):
        return next((entry for entry in entries
                     if any(t == "Linear" or matches(linear.name, t) for t in entry[0])), None)

    def stored(linear: Linear) -> int:
        _, w, fmt, static_input = group_of(linear)
        return linear.count * (_ct_matrix(linear.rows, linear.cols, w, fmt) + (FP32 if static_input else 0))

    first = entries[0][1]
    label = (f"compressed-tensors {first.get('type', 'int')}{first.get('num_bits', 8)} "
             f"({first.get('strategy', 'tensor')}{' ' + str(first['group_size']) if first.get('group_size') else ''})")
    return _Scheme(label, lambda linear: group_of(linear) is not None, stored,
                   _patterns(qc.get("ignore"), "ignore"))


def _ct_matrix(rows: int, cols: int, w: dict, fmt: str) -> int:
    """One matrix in compressed-tensors: codes, scales (model dtype, fp32 per tensor) and zero points."""
    bits, kind = w.get("num_bits", 8), w.get("type", "int")
    strategy, group = w.get("strategy", "tensor"), w.get("group_size")
    if not isinstance(bits, int) or bits <= 0:
        raise PlanError(f"compressed-tensors num_bits must be a positive integer, got {bits!r}")
    codes = _cdiv(rows * cols * bits, 8)
    if kind == "float" and bits == 4:  # NVFP4 (fp8 scale per 16) or MXFP4 (E8M0 per 32): one byte per scale
        per = group or (32 if "mxfp4" in fmt else 16)
        return codes + rows * _cdiv(cols, per) + (2 * FP32 if "mxfp4" not in fmt else 0)
    if strategy in ("group", "tensor_group"):
        scales = rows * _cdiv(cols, group or 128)
    elif strategy == "channel":
        scales = rows
    elif strategy == "block":
        block = w.get("block_structure") or [128, 128]
        scales = _cdiv(rows, block[0]) * _cdiv(cols, block[1])
    else:
        return codes + FP32 + (0 if w.get("symmetric", True) else FP32)
    zeros = 0 if w.get("symmetric", True) else _cdiv(scales * bits, 8)
    return codes + scales * FP16 + zeros + (16 if "pack" in fmt else 0)  # packed formats store the shape


def _bitsandbytes(qc: dict) -> _Scheme:
    four = bool(qc.get("load_in_4bit"))
    if not four and not qc.get("load_in_8bit"):
        raise PlanError("a bitsandbytes quantization_config needs load_in_4bit or load_in_8bit")
    double = bool(qc.get("bnb_4bit_use_double_quant"))

    def stored(linear: Linear) -> int:
        n = linear.rows * linear.cols
        if not four:
            return linear.count * (n + linear.rows * FP32)
        blocks = _cdiv(n, 64)
        absmax = blocks + _cdiv(blocks, 256) * FP32 + 256 * FP32 if double else blocks * FP32
        return linear.count * (_cdiv(n, 2) + absmax + 16 * FP32)  # codes, absmax, the 16-entry code map

    skip = qc.get("llm_int8_skip_modules")
    excluded = _patterns(skip, "llm_int8_skip_modules") if skip is not None else ("lm_head",)
    kind = qc.get("bnb_4bit_quant_type", "nf4") if four else "int8"
    label = f"bitsandbytes {kind}{' (double quantisation)' if four and double else ''}"
    return _Scheme(label, lambda linear: True, stored, excluded)


_SCHEMES = {"mxfp4": _mxfp4, "fp8": _fp8, "awq": lambda qc: _grouped(qc, "awq"),
            "gptq": lambda qc: _grouped(qc, "gptq"), "compressed-tensors": _compressed_tensors,
            "bitsandbytes": _bitsandbytes}


def stored_weights(config: dict, shape: Shape, model_type: str, params_total: int) -> Optional[StoredWeights]:
    """The bytes of a checkpoint whose config.json states a `quantization_config` (None when it states none)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise PlanError("quantization_config must be a JSON object")
    method = qc.get("quant_method")
    if method not in _SCHEMES:
        raise PlanError(f"quantization_config.quant_method {method!r} is not one kvlab counts; known: "
                        f"{', '.join(_SCHEMES)} (use --weight-dtype to plan it at a chosen precision)")
    scheme = _SCHEMES[method](qc)
    kept = model_dtype_bytes(config)
    loaded, converted = _count(scheme, linear_layers(shape, model_type))
    total = kept * params_total + loaded - kept * converted
    mtp = _mtp_bytes(config, shape, model_type, scheme, kept)
    excluded = f", {len(scheme.excluded)} module pattern(s) kept" if scheme.excluded else ""
    return StoredWeights(total, total + mtp, scheme.label + excluded, converted)


def _count(scheme: _Scheme, linears: Iterable[Linear]) -> tuple[int, int]:
    """(stored bytes of the converted linears, their parameters)."""
    stored = params = 0
    for linear in linears:
        if scheme.converts(linear) and not _excluded(linear.name, scheme.excluded):
            stored += scheme.stored(linear)
            params += linear.params
    return stored, params


def _mtp_bytes(config: dict, shape: Shape, model_type: str, scheme: _Scheme, kept: int) -> int:
    """DeepSeek's multi-token-prediction layers: a decoder layer each, plus its own embedding, head,
    the projection of [embedding; hidden] (2H -> H) and three norms, as the checkpoint stores them."""
    count = config.get("num_nextn_predict_layers") or 0
    if not isinstance(count, int) or count <= 0 or shape.latent is None:
        return 0
    last = shape.layers - 1  # an MTP layer has the shape of the last (MoE) decoder layer
    layer = [linear for linear in linear_layers(shape, model_type) if linear.name.startswith(f"model.layers.{last}.")]
    stored, converted = _count(scheme, layer)
    layer_params = sum(linear.params for linear in layer)
    extra = 2 * shape.vocab * shape.hidden + 2 * shape.hidden * shape.hidden + 3 * shape.hidden
    norms = 2 * shape.hidden + shape.latent.kv_lora_rank + shape.latent.q_lora_rank
    return count * (stored + kept * (layer_params - converted + extra + norms))
