"""Linear layers that compute straight on a GGUF file's quantised blocks, as llama.cpp does.

The weights keep the file's values, rearranged as planes (`Planes`: integer codes plus fp32
scales, and offsets, per group of 16 or 32 weights; kvlab.checkpoints.gguf_planes builds them
from Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K blocks), and each call quantises the activations per
32-element block, so every block's dot product is an integer one (csrc/ggml_gemv.c). Two
precisions, chosen per layer (`GGMLLinear(activations=...)`, the "gguf" and "gguf-a8"
packings):
- int16 (vpmaddwd), the default: about 5e-5 of relative error per product, and SmolLM2's
  greedy tokens are the dense model's.
- int8, llama.cpp's arithmetic for 4-bit blocks (`--weights gguf-a8`): one vpmaddubsw does 32
  multiply-adds (csrc/ggml_gemm_x8.c, kind 3), and SmolLM2's Q4_1 products ran 1.3-1.8x faster
  at 8 to 128 rows. It costs about 3e-3 of relative error per product (each block's exact sum
  and the int8 codes' error on it are carried, which halved the error on the test matrices): on
  the real-models report's two 2,048-token windows of Frankenstein SmolLM2's perplexity rose
  0.40% (28.15 to 28.26; int16: 28.15, `kvlab eval --weights`), 95.7% of its greedy next-token
  choices on 1,024 tokens stayed the dense model's, but near-ties flip: `kvlab generate
  --chat` answers "What is the capital of France?" with "L'Étoile, la Marseillaise, ..." where
  int16 answers "The capital of France is Paris.". Hence not the default.
Q8_0 and Q6_K blocks always meet int16 activations: on AVX2 their int8 products are no faster.

A batch-1 decode step streams about a fifth of the fp32 bytes: on one core of this
project's CPU SmolLM2's 121 products take about 12 ms in all against about 37 ms as fp32
matrices. The products run on a second copy of the weights, interleaved eight output rows at
a time (csrc/ggml_gemm_x8.c): on the AMD EPYC (Zen 3, AVX2) this project ran on, SmolLM2's
Q4_1 products of 16 rows went from about 26 to about 47 billion multiply-adds per second, of
one to three rows 1.2-1.6x faster than row by row, and of 128 to 2,048 rows they match or
pass PyTorch's fp32 GEMM on the dequantised matrix, without writing that matrix out (`prompts_on_float_gemm`
says where prompts keep that GEMM). kvlab.nn.fused_decode runs a whole decode step on these blocks in one C call.

Where the CPU has AVX-512 VNNI the same layout is multiplied with vpdpwssd / vpdpbusd on
512-bit vectors, sixteen outputs at a time (csrc/ggml_gemm_x8_vnni.c, chosen at run time:
`kernel_isa`, `KVLAB_KERNEL_ISA=avx2` to pin the AVX2 path); the integer sums are the same, so
the products are bit for bit the AVX2 kernels'. The decode step's int8 attention also follows
this choice (csrc/attend_int8.h), and is not bit-identical: it rounds the query and the
softmax weights to 15 bits. fp8 attention follows it too where the CPU also has VBMI
(csrc/attend_fp8.h, `fp8_attention_isa`); its fp32 products differ from the AVX2 loop's only in
summation order. On a 2-core Xeon with VNNI, SmolLM2's Q4_1 products of 16 rows ran at 143
billion multiply-adds per second on int16 activations against 90 for the AVX2 kernels there,
and 178 against 128 on int8 (one run, taking turns).

The C files are compiled once with the system's C compiler into ~/.cache/kvlab/kernels and
loaded with ctypes (no torch headers; about ten seconds, once per source version, most of it
the decode step's attention kernels specialised per cache format and query-head pack). Where
the machine cannot have them (no compiler, no AVX2), `kernels()` is None and loaders fall
back to other layers; a compiler that fails raises KernelBuildError instead, so a broken build is never
mistaken for a machine without AVX2.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from kvlab.errors import KvlabEnvironmentError
from torch.nn import functional as F

QK = 32
PROMPT_ROWS = 32  # where prompts_on_float_gemm(), from this many rows on a product dequantises for PyTorch's GEMM
CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "ggml_gemv.c", CSRC / "ggml_gemm_x8.c", CSRC / "ggml_gemm_x8_vnni.c", CSRC / "llama_decode.c",
           CSRC / "attend_int8_vnni.c", CSRC / "attend_fp8_vbmi.c", CSRC / "abi.c")  # built into one library
HEADERS = (CSRC / "ggml_gemv.h", CSRC / "llama_decode.h", CSRC / "kv_codecs.h", CSRC / "x8_layout.h",
           CSRC / "x8_kernel.h", CSRC / "x16_kernel.h", CSRC / "attend_int8.h",
           CSRC / "attend_fp8.h", CSRC / "attend_avx512.h", CSRC / "cpu_features.h")
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
def prompts_on_float_gemm() -> bool:
    """Whether prompts (PROMPT_ROWS rows or more) should multiply as fp32 on the dequantised matrix.

    Only where PyTorch has AVX-512 and the integer kernels do not have VNNI (Skylake-X and the
    like): there PyTorch's fp32 GEMM has twice the lanes of the AVX2 kernels, and an earlier such
    machine of this project prefilled SmolLM2 about 2.7 times faster through it. On the AVX2
    EPYC this project also ran on, the kernels match that GEMM at 2,048 rows and beat it below;
    on a Xeon with AVX-512 VNNI, SmolLM2's Q4_1 products of 128 and 512 rows ran at 127 and 116
    billion multiply-adds per second on int16 activations and 186 and 190 on int8, against 115
    for the fp32 GEMM with its dequantisation (one run, interleaved).
    """
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and kernel_isa() != "avx512_vnni"


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
    library = CACHE_DIR / f"ggml_gemv-{digest.hexdigest()[:16]}.so"
    if not library.is_file():
        try:
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
                built = Path(tmp) / library.name
                subprocess.run([compiler, *flags, "-o", str(built), *map(str, SOURCES), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, library)  # atomic: parallel builders never load a half-written file
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
    lib.llama_decode_step.argtypes = [ptr, i32, i32, i32, ptr, ptr, ptr]
    lib.llama_decode_step.restype = i32
    lib.llama_paged_decode_step.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32, ptr, ptr, ptr]
    lib.llama_paged_decode_step.restype = i32
    lib.llama_paged_step.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32, ptr, ptr, i32, ptr, ptr]
    lib.llama_paged_step.restype = i32
    lib.kvlab_arena_new.argtypes, lib.kvlab_arena_new.restype = [], ptr
    lib.kvlab_arena_free.argtypes, lib.kvlab_arena_free.restype = [ptr], None
    lib.kvlab_fp8_encode.argtypes, lib.kvlab_fp8_encode.restype = [i32, ptr, ptr, ctypes.c_size_t], None
    lib.kvlab_int8_quantize.argtypes = [ptr, i32, i32, i32, ptr, ptr, ptr]
    lib.kvlab_int8_quantize.restype = None
    lib.quantize_act.argtypes, lib.quantize_act.restype = [ptr, ctypes.c_size_t, ptr], None
    lib.kvlab_x8_isa.argtypes, lib.kvlab_x8_isa.restype = [], i32
    lib.kvlab_x8_set_isa.argtypes, lib.kvlab_x8_set_isa.restype = [i32], i32
    lib.fp8_vbmi_usable.argtypes, lib.fp8_vbmi_usable.restype = [], i32
    from kvlab.nn.c_abi import abi_mismatches, abi_table

    problems = abi_mismatches(abi_table(lib))
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


GROUP = {"q4_1": 32, "q8_0": 32, "q6_k": 16}  # weights per scale in each planes kind
KIND_IDS = {"q4_1": 0, "q8_0": 1, "q6_k": 2}  # the C side's `kind`
INT8_KIND_IDS = {"q4_1": 3}  # ... where activations are int8 (the others' products gain nothing from it)
ACTIVATIONS = ("int8", "int16")
# The packing each activation precision gives a model (Decoder.packing): "gguf" keeps int16
# activations throughout (the default), "gguf-a8" computes as llama.cpp does (int8 on 4-bit blocks).
PACKING_OF = {"int16": "gguf", "int8": "gguf-a8"}


@dataclass
class Planes:
    """A matrix [rows, cols] as integer codes in natural order plus fp32 scales per group:
    w = code x scale (+ offset). kvlab.checkpoints.gguf_planes turns GGUF blocks into these.

    "q4_1": codes 0..15 (uint8), a scale and an offset per 32 weights;
    "q8_0": int8 codes, a scale per 32; "q6_k": int8 codes, a scale per 16.
    """

    kind: str
    codes: torch.Tensor  # [rows, cols]
    scales: torch.Tensor  # fp32 [rows, cols / GROUP[kind]]
    offsets: Optional[torch.Tensor] = None  # fp32 like scales, "q4_1" only

    def dense(self) -> torch.Tensor:
        """The fp32 weights the planes encode."""
        rows, cols = self.codes.shape
        weights = self.codes.float().view(rows, -1, GROUP[self.kind]) * self.scales[..., None]
        if self.offsets is not None:
            weights = weights + self.offsets[..., None]
        return weights.reshape(rows, cols)

    def map_rows(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> "Planes":
        """The same matrix with `transform` (a row permutation) applied to every plane."""
        offsets = transform(self.offsets) if self.offsets is not None else None
        return Planes(self.kind, transform(self.codes), transform(self.scales), offsets)

    def packed(self) -> "PackedPlanes":
        """The same matrix in the layout GGMLLinear keeps (two "q4_1" codes to a byte)."""
        rows, cols = self.codes.shape
        if self.kind == "q4_1":  # per 32 weights, 16 bytes: low nibbles weights 0..15, high nibbles 16..31
            codes = self.codes.to(torch.uint8).view(rows, -1, 2, 16)
            packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(rows, -1)
        else:
            packed = self.codes.to(torch.int8)
        offsets = self.offsets.float().contiguous() if self.offsets is not None else None
        return PackedPlanes(self.kind, cols, packed.contiguous(), self.scales.float().contiguous(), offsets)


@dataclass
class PackedPlanes:
    """Planes as GGMLLinear holds them and the C kernels read them, every tensor contiguous.

    "q4_1" codes are two to a byte, per 32 weights 16 bytes: low nibbles weights 0..15, high
    nibbles 16..31, which is how GGUF's Q4_0 and Q4_1 blocks store them, so a loader can copy
    those bytes as they lie (kvlab.checkpoints.gguf_planes.packed_from_blocks) instead of
    unpacking codes to bytes and packing them again. Other kinds keep int8 codes, one a byte.
    """

    kind: str
    cols: int  # weights per row (a "q4_1" row holds cols / 2 bytes)
    codes: torch.Tensor  # uint8 [rows, cols / 2] for "q4_1", int8 [rows, cols] otherwise
    scales: torch.Tensor  # fp32 [rows, cols / GROUP[kind]]
    offsets: Optional[torch.Tensor] = None  # fp32 like scales, "q4_1" only

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def check(self) -> None:
        """ValueError unless the tensors describe one matrix of this kind in the kernels' layout."""
        kind, rows, cols = self.kind, self.rows, self.cols
        if kind not in GROUP:
            raise ValueError(f"unsupported planes kind {kind!r}; expected one of {sorted(GROUP)}")
        width, dtype = (cols // 2, torch.uint8) if kind == "q4_1" else (cols, torch.int8)
        groups = (rows, cols // GROUP[kind]) if cols % QK == 0 else None
        if (cols % QK or self.codes.shape != (rows, width) or self.codes.dtype != dtype
                or self.scales.shape != groups or self.scales.dtype != torch.float32
                or (self.offsets is not None) != (kind == "q4_1")
                or (self.offsets is not None and (self.offsets.shape != groups or self.offsets.dtype != torch.float32))
                or not all(t.is_contiguous() for t in (self.codes, self.scales, self.offsets) if t is not None)):
            raise ValueError(f"packed {kind} planes of codes {list(self.codes.shape)} ({self.codes.dtype}) and "
                             f"scales {list(self.scales.shape)} do not describe one {cols}-column matrix")


def stack_planes(parts: list[Planes]) -> Planes:
    """Row-stacked matrices of one kind (Q, K and V rows; gate and up rows) as one."""
    if len({part.kind for part in parts}) != 1:
        raise ValueError("only planes of one kind stack")
    offsets = torch.cat([part.offsets for part in parts]) if parts[0].offsets is not None else None
    return Planes(parts[0].kind, torch.cat([part.codes for part in parts]),
                  torch.cat([part.scales for part in parts]), offsets)


class GGMLLinear(nn.Module):
    """y = x W^T with W [out, in] held as planes (codes, per-group fp32 scales and offsets):
    GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K blocks rearranged without changing a weight.

    `activations` is the precision x is quantised to per 32 values for "q4_1" planes: "int16"
    (the default: the dense model's greedy tokens) or "int8" (llama.cpp's arithmetic: SmolLM2's
    products 1.3-1.8x faster, its perplexity +0.40%). Q8_0 and Q6_K planes always meet int16
    activations (ggml_gemv.h's qacts)."""

    def __init__(self, planes: "Planes | PackedPlanes", activations: str = "int16"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations are {' or '.join(ACTIVATIONS)}, not {activations!r}")
        self.activations, self.packing = activations, PACKING_OF[activations]
        if isinstance(planes, Planes):
            kind, (rows, cols) = planes.kind, planes.codes.shape
            if kind not in GROUP:
                raise ValueError(f"unsupported planes kind {kind!r}; expected one of {sorted(GROUP)}")
            if cols % QK or planes.scales.shape != (rows, cols // GROUP[kind]) \
                    or (planes.offsets is not None) != (kind == "q4_1"):
                raise ValueError(f"{kind} planes of codes {list(planes.codes.shape)} and scales "
                                 f"{list(planes.scales.shape)} do not describe one matrix")
            planes = planes.packed()
        planes.check()
        if kernels() is None:
            raise RuntimeError("the GGML kernels are unavailable on this machine (no C compiler or no AVX2)")
        self.kind, self.in_features, self.out_features = planes.kind, planes.cols, planes.rows
        self.kind_id = (INT8_KIND_IDS if activations == "int8" else KIND_IDS).get(planes.kind, KIND_IDS[planes.kind])
        if planes.offsets is not None:
            self.register_buffer("offsets", planes.offsets)
        else:
            self.offsets = None
        self.register_buffer("codes", planes.codes)
        self.register_buffer("scales", planes.scales)
        self._interleave()

    def _interleave(self) -> None:
        """The copy csrc/ggml_gemm_x8.c multiplies with: eight output rows' weights per vector.
        Derived from the planes, so it is not saved with the state dict."""
        lib, (kind, n, k) = kernels(), (self.kind_id, self.out_features, self.in_features)
        codes8 = torch.empty(lib.x8_codes_bytes(kind, n, k), dtype=torch.uint8)
        d8 = torch.empty(lib.x8_scales_count(kind, n, k))
        m8 = torch.empty(lib.x8_scales_count(kind, n, k)) if self.offsets is not None else None
        lib.qmatrix_interleave(*self.planes(), n, k, codes8.data_ptr(), d8.data_ptr(), address(m8))
        self.register_buffer("codes8", codes8, persistent=False)
        self.register_buffer("d8", d8, persistent=False)
        self.register_buffer("m8", m8, persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not narrow the scales and offsets: the C kernels read
        # them as fp32 (and they are the file's exact values). Keep the fp32 tensors themselves.
        kept = {name: getattr(self, name) for name in ("scales", "offsets", "d8", "m8") if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            setattr(self, name, tensor.to(getattr(self, name).device))
        return self

    def planes(self) -> tuple[int, Optional[int], Optional[int], Optional[int]]:
        """(kind, codes, scales, offsets) as the C functions take them: addresses, None for no offsets.
        Valid while this layer's buffers stay where they are (no `.to()` in between)."""
        assert self.scales.dtype == torch.float32 and self.codes.device.type == "cpu"
        return self.kind_id, self.codes.data_ptr(), self.scales.data_ptr(), address(self.offsets)

    def interleaved(self) -> tuple[int, int, Optional[int]]:
        """(codes8, d8, m8) addresses of the interleaved copy, as the C functions take them."""
        return self.codes8.data_ptr(), self.d8.data_ptr(), address(self.m8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One C call per layer per step: at batch 1 Python overhead is a real share of a step.
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        if flat.shape[0] >= PROMPT_ROWS and prompts_on_float_gemm():
            return F.linear(flat, self.weight).view(*x.shape[:-1], self.out_features).to(x.dtype)
        y = torch.empty(flat.shape[0], self.out_features)
        if kernels().ggml_linear(*self.planes(), *self.interleaved(), self.out_features, self.in_features, flat.shape[0],
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"activations={self.activations}")


class GGMLStack(nn.Module):
    """Row-stacked GGMLLinear parts of different kinds, outputs side by side: one matrix to the
    model (Q, K and V rows; gate and up rows), separate planes to the kernels. llama.cpp's
    Q4_K_M files mix kinds within a stack (Q4_K queries and keys beside Q6_K values)."""

    def __init__(self, parts: list[GGMLLinear]):
        super().__init__()
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("stacked parts must share their input width")
        if len({part.packing for part in parts}) != 1:
            raise ValueError("stacked parts must share their activations")
        self.packing = parts[0].packing
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([part.weight for part in self.parts])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def ggml_layer(parts: list, stack: Optional[Callable[[list], "Planes | PackedPlanes"]] = None,
               activations: str = "int16") -> nn.Module:
    """Row-stacked planes as one layer: consecutive parts of one kind share a GGMLLinear, and a
    GGMLStack lays kinds side by side where they differ. `stack` joins a run of one kind
    (default `stack_planes`, for `Planes`; loaders pass kvlab.checkpoints.gguf_planes.stack_packed)."""
    groups: list[list] = []
    for part in parts:
        if groups and groups[-1][0].kind == part.kind:
            groups[-1].append(part)
        else:
            groups.append([part])
    layers = [GGMLLinear((stack or stack_planes)(group), activations) for group in groups]
    return layers[0] if len(layers) == 1 else GGMLStack(layers)


def address(tensor: Optional[torch.Tensor]) -> Optional[int]:
    """A tensor's address as the C functions take it, None (NULL) for no tensor."""
    return tensor.data_ptr() if tensor is not None else None


def quantize_activations(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The C kernels' quantisation of fp32 activations x [..., k] (k a multiple of 32), per
    32-value block: "q" int16 codes and "d" their scales, "s" exact sums, "q8" int8 codes,
    "d8" their scales and "e8" each sum minus d8 times its codes' sum (ggml_gemv.h's qacts).
    What a product's exact integer reference is computed from (tests/nn/test_ggml.py)."""
    from kvlab.nn.c_abi import QActs

    x = x.detach().float().contiguous()
    if x.shape[-1] % 32:
        raise ValueError(f"activations come in blocks of 32 values, got {x.shape[-1]} per row")
    blocks = x.numel() // 32
    out = {"q": torch.empty(x.numel(), dtype=torch.int16), "q8": torch.empty(x.numel(), dtype=torch.int8),
           **{name: torch.empty(blocks) for name in ("d", "s", "d8", "e8")}}
    acts = QActs(*(out[name].data_ptr() for name in ("q", "d", "s", "q8", "d8", "e8")))
    kernels().quantize_act(x.data_ptr(), x.numel(), ctypes.byref(acts))
    return out
