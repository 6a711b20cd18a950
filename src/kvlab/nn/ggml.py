"""Linear layers that compute straight on a GGUF file's Q4_1 / Q8_0 blocks, as llama.cpp does.

The weights keep the file's values (Q4_1: 4-bit codes plus a scale and an offset per 32
weights; Q8_0: 8-bit codes plus a scale), and each call quantises the activations to int16
per 32-element block, so every block's dot product is an integer one (csrc/ggml_gemv.c,
AVX2 madd). llama.cpp quantises activations to int8 instead (one maddubs per block, a
little faster), which costs about 0.5% relative error per product: enough to flip near-tied
tokens of SmolLM2 (its answer to "What is the capital of France?" began "L'Étoile..." with
int8 activations). With int16 the error is about 5e-5 and SmolLM2's greedy tokens are the
dense model's.

A batch-1 decode step streams about a fifth of the fp32 bytes: on one core of this
project's CPU SmolLM2's 121 products take about 12 ms in all against about 37 ms as fp32
matrices. Prompts (PREFILL_ROWS rows or more) dequantise each matrix in C and use PyTorch's
float GEMM. kvlab.nn.fused_decode runs a whole decode step on these blocks in one C call.

The C files are compiled once with the system's C compiler into ~/.cache/kvlab/kernels and
loaded with ctypes (no torch headers, so it builds in about a second). Where that cannot
happen (no compiler, no AVX2), `kernels()` is None and loaders fall back to other layers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

QK = 32
PREFILL_ROWS = 32  # from this many activation rows on, dequantising for a float GEMM is faster here
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "ggml_gemv.c", CSRC / "llama_decode.c")  # built into one library
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlab" / "kernels"


@lru_cache(maxsize=1)
def kernels() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None where this machine cannot build or run them."""
    if os.environ.get("KVLAB_NO_KERNELS") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, CSRC / "ggml_gemv.h")))
    library = CACHE_DIR / f"ggml_gemv-{digest.hexdigest()[:16]}.so"
    if not library.is_file():
        if compiler is None:
            return None
        try:
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
                built = Path(tmp) / library.name
                flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
                subprocess.run([compiler, *flags, "-o", str(built), *map(str, SOURCES), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, library)  # atomic: parallel builders never load a half-written file
        except (OSError, subprocess.SubprocessError):
            return None
    lib = ctypes.CDLL(str(library))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.ggml_linear.argtypes = [i32, ptr, ptr, ptr, i32, i32, i32, ptr, ptr]
    lib.ggml_linear.restype = i32
    lib.ggml_dequantize.argtypes = [i32, ptr, ptr, ptr, i32, i32, ptr]
    lib.ggml_dequantize.restype = None
    lib.llama_decode_step.argtypes = [ptr, i32, ptr, ptr]
    lib.llama_decode_step.restype = i32
    return lib


class GGMLLinear(nn.Module):
    """y = x W^T with W [out, in] held as GGUF Q4_1 or Q8_0 blocks, split into planes:
    the codes as stored, and each block's fp16 scale (and Q4_1 offset) widened to fp32, exactly."""

    packing = "gguf"

    def __init__(self, rows: torch.Tensor, kind: str, in_features: int):
        """rows: uint8 [out, in / 32 * block bytes], the file's bytes for each output row."""
        super().__init__()
        if kind not in BLOCK_BYTES:
            raise ValueError(f"unsupported block kind {kind!r}; expected one of {sorted(BLOCK_BYTES)}")
        if in_features % QK or rows.shape[1] != in_features // QK * BLOCK_BYTES[kind]:
            raise ValueError(f"{kind} rows of {rows.shape[1]} bytes do not hold {in_features} weights")
        if kernels() is None:
            raise RuntimeError("the GGML kernels are unavailable on this machine (no C compiler or no AVX2)")
        self.kind, self.in_features, self.out_features = kind, in_features, rows.shape[0]
        self.kind_id = 0 if kind == "q4_1" else 1  # the C side's `kind`
        blocks = rows.reshape(self.out_features, -1, BLOCK_BYTES[kind])
        self.register_buffer("scales", blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1))
        if kind == "q4_1":
            self.register_buffer("offsets", blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1))
            self.register_buffer("codes", blocks[..., 4:].reshape(self.out_features, -1).contiguous())
        else:
            self.offsets = None
            self.register_buffer("codes", blocks[..., 2:].contiguous().view(torch.int8).reshape(self.out_features, -1))

    def planes(self) -> tuple[int, Optional[int], Optional[int], Optional[int]]:
        """(kind, codes, scales, offsets) as the C functions take them: addresses, None for no offsets.
        Valid while this layer's buffers stay where they are (no `.to()` in between)."""
        offsets = self.offsets.data_ptr() if self.offsets is not None else None
        return self.kind_id, self.codes.data_ptr(), self.scales.data_ptr(), offsets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One C call per layer per step: at batch 1 Python overhead is a real share of a step.
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        if flat.shape[0] >= PREFILL_ROWS:
            return F.linear(flat, self.weight).view(*x.shape[:-1], self.out_features).to(x.dtype)
        y = torch.empty(flat.shape[0], self.out_features)
        if kernels().ggml_linear(*self.planes(), self.out_features, self.in_features, flat.shape[0],
                                 flat.data_ptr(), y.data_ptr()):
            raise MemoryError("ggml_linear could not allocate its activation buffers")
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dense fp32 [out, in] weights the blocks encode, exactly."""
        dense = torch.empty(self.out_features, self.in_features)
        kernels().ggml_dequantize(*self.planes(), self.out_features, self.in_features, dense.data_ptr())
        return dense

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"
