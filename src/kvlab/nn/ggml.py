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
pass PyTorch's fp32 GEMM on the dequantised matrix, without writing that matrix out. Where a
library product is faster from some row count on (matrix engines), kvlab.nn.matmul_backend
measures that crossover and sends those products there. kvlab.nn.c_model runs a whole
decode step on these blocks in one C call.

The C kernels, their build and the instruction set they run on are kvlab.nn.kernels'.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from kvlab.nn.kernels import kernels
from kvlab.nn.matmul_backend import library_dtype, library_product, uses_library

QK = 32


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
        if uses_library(self, flat.shape[0]):  # many rows, where the library is faster (matmul_backend)
            y = library_product(flat, self.library_weight())
        else:
            y = self.kernel_product(flat)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def kernel_product(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [rows, in] fp32 times the blocks, in the C kernels: fp32 [rows, out]."""
        y = torch.empty(flat.shape[0], self.out_features)
        if kernels().ggml_linear(*self.planes(), *self.interleaved(), self.out_features, self.in_features, flat.shape[0],
                                 flat.data_ptr(), y.data_ptr()):
            raise MemoryError("ggml_linear could not allocate its activation buffers")
        return y

    def library_weight(self) -> torch.Tensor:
        """The dense copy the library multiplies by (kvlab.nn.matmul_backend.library_dtype), made
        once, the first time it is needed, and kept (not saved: the blocks are the weights)."""
        copy = self.__dict__.get("_library_weight")
        if copy is None:
            copy = self.weight.to(library_dtype())
            self.__dict__["_library_weight"] = copy
        return copy

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
