"""Dense matrices as Q8_0 planes, so a model trained here (a speculative draft) runs on the C steps.

The C decode steps compute on GGUF-style planes only (kvlab.nn.ggml). A model kvlab trained
itself is dense fp32; `pack_q8_0` rounds each of its matrices to GGUF's Q8_0 rule (per 32
weights, scale = max |w| / 127, codes = round(w / scale)), a relative error of about 0.4%
per weight, and swaps the Linear layers for GGMLLinear ones. The embedding table stays dense
(the C step takes embeddings as input), so a tied LM head becomes a packed copy of it.

`--weights q8_0` (kvlab.checkpoints.resolve) packs any loaded model this way, a converted
directory's safetensors included. An MLA model's projections are its query, its latent and
RoPE-key projection and its output; its up-projection (W_uk, W_uv) stays dense, since decoding
folds it into the query and the attention output as fp32 matrices rather than multiplying by
it as a layer.
"""

from __future__ import annotations

import copy

import torch

from kvlab.nn.ggml import QK, GGMLLinear, Planes
from kvlab.nn.model import Decoder

PACKED = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
PACKED_MLA = ("attn.wq", "attn.wkv_a", "attn.o", "mlp.gate_up", "mlp.down")


def q8_0_planes(weight: torch.Tensor) -> Planes:
    """weight [rows, cols] (cols a multiple of 32) -> q8_0 planes: int8 codes, an fp32 scale per 32."""
    rows, cols = weight.shape
    if cols % QK:
        raise ValueError(f"Q8_0 packs rows of a multiple of {QK} weights, not {cols}")
    groups = weight.detach().float().reshape(rows, cols // QK, QK)
    scales = groups.abs().amax(dim=-1) / 127.0
    codes = torch.where(scales[..., None] > 0, groups / scales.clamp_min(1e-30)[..., None], 0.0)
    return Planes("q8_0", codes.round().clamp(-127, 127).to(torch.int8).reshape(rows, cols), scales.contiguous())


def pack_q8_0(model: Decoder, in_place: bool = False) -> Decoder:
    """A copy of `model` (or `model` itself, `in_place`) whose projections and LM head are Q8_0
    GGMLLinear layers (biases unsupported)."""
    if model.config.bias:
        raise ValueError("Q8_0 packing here covers bias-free models")
    packed = model if in_place else copy.deepcopy(model)
    names = PACKED_MLA if model.config.attention == "mla" else PACKED
    for block in packed.blocks:
        for name in names:
            block.set_submodule(name, GGMLLinear(q8_0_planes(block.get_submodule(name).weight)))
    packed.lm_head = GGMLLinear(q8_0_planes(model.lm_head.weight))
    return packed.eval()
