"""kvlab's C kernels: built once with the system's compiler, loaded with ctypes, and the
instruction set their products run on.

The products on GGUF blocks (kvlab.nn.ggml) and the whole decode step (kvlab.nn.c_model,
kvlab.nn.paged_decode) are one library compiled from csrc/.

Where the CPU has AVX-512 VNNI the products' layout (kvlab.nn.ggml) is multiplied with vpdpwssd
/ vpdpbusd on 512-bit vectors, sixteen outputs at a time (csrc/ggml_gemm_x8_vnni.c, chosen at
run time: `kernel_isa`, `KVLAB_KERNEL_ISA=avx2` to pin the AVX2 path); the integer sums are the
same, so the products are bit for bit the AVX2 kernels'. The decode step's int8 attention also
follows this choice (csrc/attend_int8.h), and is not bit-identical: it rounds the query and the
softmax weights to 15 bits. fp8 attention follows it too where the CPU also has VBMI
(csrc/attend_fp8.h, `fp8_attention_isa`); its fp32 products differ from the AVX2 loop's only in
summation order. On a 2-core Xeon with VNNI, SmolLM2's Q4_1 products of 16 rows ran at 143
billion multiply-adds per second on int16 activations against 90 for the AVX2 kernels there, and
178 against 128 on int8 (one run, taking turns).

The C files are compiled once with the system's C compiler into ~/.cache/kvlab/kernels and
loaded with ctypes (no torch headers; about ten seconds, once per source version, most of it the
decode step's attention kernels specialised per cache format and query-head pack). Where the
machine cannot have them (no compiler, no AVX2), `kernels()` is None and loaders fall back to
other layers; a compiler that fails raises KernelBuildError instead, so a broken build is never
mistaken for a machine without AVX2.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import torch

from kvlab.errors import KvlabEnvironmentError
from kvlab.files import write_atomic

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "ggml_gemv.c", CSRC / "ggml_gemm_x8.c", CSRC / "ggml_gemm_x8_vnni.c", CSRC / "llama_decode.c",
           CSRC / "attend_int8_vnni.c", CSRC / "attend_fp8_vbmi.c", CSRC / "abi.c")  # built into one library
HEADERS = (CSRC / "ggml_gemv.h", CSRC / "llama_decode.h", CSRC / "kv_codecs.h", CSRC / "x8_layout.h",
           CSRC / "x8_kernel.h", CSRC / "x16_kernel.h", CSRC / "attend_int8.h",
           CSRC / "attend_fp8.h", CSRC / "attend_avx512.h", CSRC / "cpu_features.h", CSRC / "mla_attend.h",
           CSRC / "kvquant.h", CSRC / "kvquant_write.h", CSRC / "kvquant_nibbles.h",
           CSRC / "kvquant_attend.h", CSRC / "kivi_attend.h")
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlab" / "kernels"


class KernelBuildError(KvlabEnvironmentError):
    """The C kernels failed to compile on a machine that has a compiler and AVX2: a broken
    build, never a reason to fall back quietly (the fused step is the default decode path)."""


def kernels_unavailable() -> Optional[str]:
    """Why this machine cannot have the kernels (no AVX2, no compiler, switched off), or None."""
    if os.environ.get("KVLAB_NO_KERNELS"):
        return "KVLAB_NO_KERNELS is set"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')} or gcc) on PATH"
    return None


@lru_cache(maxsize=1)
def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


_BUILD_FAILURE: list[KernelBuildError] = []  # a failed build is remembered, not retried every call


def kernels() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None where this machine cannot have them (`kernels_unavailable`).

    Raises KernelBuildError when a compiler and AVX2 are present but the build fails.
    """
    if _BUILD_FAILURE:
        raise _BUILD_FAILURE[0]
    try:
        return _load_kernels()
    except KernelBuildError as error:
        _BUILD_FAILURE.append(error)
        raise


@lru_cache(maxsize=1)
def _load_kernels() -> Optional[ctypes.CDLL]:
    if kernels_unavailable() is not None:
        return None
    compiler = _compiler()
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)))
    digest.update(" ".join([compiler, *flags]).encode())  # a new compiler or flag builds anew
    # kvlab's whole C library (block products, KV codecs, attention, the paged decode step), not only GEMV
    library = CACHE_DIR / f"kvlab_kernels-{digest.hexdigest()[:16]}.so"
    if not library.is_file():
        try:
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
                built = Path(tmp) / library.name
                subprocess.run([compiler, *flags, "-o", str(built), *map(str, SOURCES), "-lm"], check=True,
                               capture_output=True, timeout=120)
                write_atomic(library, built.read_bytes())  # parallel builders never load a half-written file
        except subprocess.CalledProcessError as error:
            detail = (error.stderr or b"").decode(errors="replace").strip().splitlines()
            raise KernelBuildError(f"building kvlab's C kernels with {compiler} failed (exit {error.returncode})"
                                   + (f": {detail[0]}" if detail else "")) from None
        except (OSError, subprocess.SubprocessError) as error:
            raise KernelBuildError(f"building kvlab's C kernels with {compiler} failed: {error}") from None
    lib = ctypes.CDLL(str(library))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.ggml_linear.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, ptr, ptr]
    lib.ggml_linear.restype = i32
    lib.ggml_dequantize.argtypes = [i32, ptr, ptr, ptr, i32, i32, ptr]
    lib.ggml_dequantize.restype = None
    lib.x8_codes_bytes.argtypes = lib.x8_scales_count.argtypes = [i32, i32, i32]
    lib.x8_codes_bytes.restype = lib.x8_scales_count.restype = ctypes.c_size_t
    lib.qmatrix_interleave.argtypes = [i32, ptr, ptr, ptr, i32, i32, ptr, ptr, ptr]
    lib.qmatrix_interleave.restype = None
    lib.exp_nonpositive.argtypes = [ptr, ptr, i32]
    lib.exp_nonpositive.restype = None
    lib.llama_paged_decode_step.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32, ptr, ptr, ptr]
    lib.llama_paged_decode_step.restype = i32
    lib.llama_paged_step.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32, ptr, ptr, i32, ptr, ptr, ptr]
    lib.llama_paged_step.restype = i32
    lib.llama_paged_attend.argtypes = [ptr, i32, i32, ptr, ptr, i32, i32, i32, ptr, ptr, ptr]
    lib.llama_paged_attend.restype = i32
    lib.kvlab_arena_new.argtypes, lib.kvlab_arena_new.restype = [], ptr
    lib.kvlab_arena_free.argtypes, lib.kvlab_arena_free.restype = [ptr], None
    lib.kvlab_fp8_encode.argtypes, lib.kvlab_fp8_encode.restype = [i32, ptr, ptr, ctypes.c_size_t], None
    lib.kvlab_group_quantize.argtypes = [ptr, i32, i32, i32, i32, ptr, ptr, ptr]
    lib.kvlab_kvquant_store.argtypes = [ptr, i32, i32, i32, i32, ptr, ptr, ptr, i32, i32]
    lib.kvlab_kvquant_store.restype = i32
    lib.kvlab_group_quantize.restype = None
    lib.kvlab_kivi_store.argtypes = [ptr, ptr, *[i32] * 9, ptr, ptr, ptr]  # k, v planes; format and sequence; rows
    lib.kvlab_kivi_store.restype = None
    lib.quantize_act.argtypes, lib.quantize_act.restype = [ptr, ctypes.c_size_t, ptr], None
    lib.kvlab_x8_isa.argtypes, lib.kvlab_x8_isa.restype = [], i32
    lib.kvlab_x8_set_isa.argtypes, lib.kvlab_x8_set_isa.restype = [i32], i32
    lib.fp8_vbmi_usable.argtypes, lib.fp8_vbmi_usable.restype = [], i32
    from kvlab.nn.c_abi import PAGED_ATTEND_ARGS, PAGED_STEP_ARGS, abi_mismatches, abi_table

    problems = abi_mismatches(abi_table(lib))
    for name, count in (("llama_paged_step", PAGED_STEP_ARGS), ("llama_paged_attend", PAGED_ATTEND_ARGS)):
        if len(getattr(lib, name).argtypes) != count:
            problems.append(f"{name} takes {count} arguments in C, {len(getattr(lib, name).argtypes)} in its binding")
    if problems:  # a drifted ctypes mirror would pass shifted pointers to C: refuse the library
        raise KernelBuildError(f"{library.name} does not match kvlab.nn.c_abi's mirrors: " + "; ".join(problems))
    asked = os.environ.get(ISA_VARIABLE)
    if asked:
        if asked not in KERNEL_ISAS:
            raise KvlabEnvironmentError(f"{ISA_VARIABLE}={asked!r}: choose one of {', '.join(KERNEL_ISAS)}")
        if lib.kvlab_x8_set_isa(KERNEL_ISAS.index(asked)) != 0:
            raise KvlabEnvironmentError(f"{ISA_VARIABLE}={asked}: this CPU (or its OS) lacks {asked}")
    return lib


# The products' instruction sets (csrc/x8_layout.h's X8_ISA_*, in order): AVX2 on every machine
# the kernels load on, AVX-512 VNNI where the CPU has it (chosen by default; bit-identical).
KERNEL_ISAS = ("avx2", "avx512_vnni")
ISA_VARIABLE = "KVLAB_KERNEL_ISA"  # set to one of KERNEL_ISAS to pin it (same-run comparisons, tests)


def kernel_isa() -> Optional[str]:
    """The instruction set the products run on ("avx2", "avx512_vnni"), or None without kernels."""
    lib = kernels()
    return None if lib is None else KERNEL_ISAS[lib.kvlab_x8_isa()]


def fp8_attention_isa() -> Optional[str]:
    """Where the decode step's fp8 attention runs: "avx512_vbmi" (its own unit, with the AVX-512
    products and a CPU with VBMI) or "avx2" (the loop every format shares); None without kernels."""
    lib = kernels()
    if lib is None:
        return None
    return "avx512_vbmi" if KERNEL_ISAS[lib.kvlab_x8_isa()] == "avx512_vnni" and lib.fp8_vbmi_usable() else "avx2"


@contextmanager
def using_kernel_isa(isa: str) -> Iterator[None]:
    """Run the products on `isa` inside the block (KvlabEnvironmentError where the machine lacks it)."""
    lib = kernels()
    if lib is None:
        raise KvlabEnvironmentError("kvlab's C kernels are not available on this machine")
    if isa not in KERNEL_ISAS:
        raise ValueError(f"unknown instruction set {isa!r}: choose one of {', '.join(KERNEL_ISAS)}")
    before = lib.kvlab_x8_isa()
    if lib.kvlab_x8_set_isa(KERNEL_ISAS.index(isa)) != 0:
        raise KvlabEnvironmentError(f"this CPU (or its OS) lacks {isa}")
    try:
        yield
    finally:
        lib.kvlab_x8_set_isa(before)
