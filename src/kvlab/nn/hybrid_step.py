"""A decode step of many rows with its products in the library and its attention in C over the pool.

The fused C step (kvlab.nn.paged_decode) runs every product on kvlab's GGUF-block kernels, which
pay about 15% more per extra row: the right choice at one row and on CPUs without matrix engines.
Where the CPU has them (AMX, AVX-512 BF16), oneDNN multiplies 16-32 rows in about one row's time
(issue 36), so a batch of decode rows, or a verification's k + 1 rows, should go there. This step
does that: per layer, the norms, the QKV, output and MLP products in torch on each matrix's
library copy (kvlab.nn.matmul_backend.library_product: bf16 where the CPU multiplies it in
hardware, else fp32), and between them one C call (`llama_paged_attend`, csrc/llama_decode.c)
that applies q/k norms and RoPE, writes each row's K/V into the pool through its codecs and
attends over the row's blocks, the fused step's own code for that part; then the LM head in the
library too, for the rows asked. What it writes into the pool is what the fused step writes up
to the products' rounding, so either step (or the module path) can run the next one.

`HybridDecodeStep` has `PagedDecodeStep`'s interface (`step(ids, batch)`, `feeds`, `rows`), so
the engine's runner takes it for decode and verification steps whose rows are at or above the
machine's measured crossover (`uses_library`) and the fused step below. GQA models only (an MLA
layer's absorbed attention reads its projections inside C): `why_not_hybrid` says why not.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from kvlab.cache.pool import KVPool
from kvlab.nn.c_model import embed_rows
from kvlab.nn.ggml import GGMLStack
from kvlab.nn.kernels import kernels
from kvlab.nn.matmul_backend import library_product
from kvlab.nn.model import Decoder
from kvlab.nn.paged_decode import ERRORS, PagedDecodeStep, why_not_paged


def why_not_hybrid(model: Decoder, pool) -> Optional[str]:
    """None when `HybridDecodeStep` can run `model` on `pool`, else the reason it cannot."""
    reason = why_not_paged(model, pool)
    if reason is not None:
        return reason
    if model.config.attention != "gqa":
        return "the hybrid step's C attention takes grouped-query layers (an MLA layer projects inside C)"
    if getattr(pool, "planes", None) is not None:
        return ("the hybrid step's C attention writes per-token codecs; KIVI and KVQuant pools write in their own "
                "layer code")
    return None


def product(x: torch.Tensor, layer) -> torch.Tensor:
    """x [rows, in] fp32 times a GGMLLinear's (or a GGMLStack's parts') library copy: fp32 [rows, out].
    The copies are the layers' own (made once, shared with the module path's library products)."""
    if isinstance(layer, GGMLStack):
        return torch.cat([library_product(x, part.library_weight()) for part in layer.parts], dim=-1)
    return library_product(x, layer.library_weight())


class HybridDecodeStep(PagedDecodeStep):
    """`PagedDecodeStep` whose products run in the library (module doc); same arguments, same calls."""

    def __init__(self, model: Decoder, pool: KVPool, max_rows: int, num_layers: Optional[int] = None):
        reason = why_not_hybrid(model, pool)
        if reason is not None:
            raise ValueError(f"cannot run the hybrid decode step: {reason}")
        super().__init__(model, pool, max_rows, num_layers)
        self.blocks = list(model.blocks)[:self._struct.n_layers]

    def warm(self) -> None:
        """Make every matrix's library copy now (start-up), not inside the first large step."""
        for block in self.blocks:
            for layer in (block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down):
                for part in layer.parts if isinstance(layer, GGMLStack) else [layer]:
                    part.library_weight()
        self.model.lm_head.library_weight()

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
             logit_rows: Optional[list[int]] = None, hidden: Optional[torch.Tensor] = None,
             inputs: Optional[torch.Tensor] = None, seats: Optional[torch.Tensor] = None) -> torch.Tensor:
        # `seats`: PagedDecodeStep's signature; the pools this step takes (why_not_hybrid) keep no per-seat state
        rows, config = int(ids.numel()), self.model.config
        positions = positions.to(torch.int32).contiguous()
        tables = tables.contiguous()
        if inputs is not None:
            if tuple(inputs.shape) != (rows, config.dim):
                raise ValueError(f"inputs must be [{rows}, {config.dim}], got {list(inputs.shape)}")
            x = inputs.to(torch.float32)
        else:
            x = embed_rows(self.model, ids.reshape(rows))
        if hidden is not None and (tuple(hidden.shape) != (rows, config.dim) or hidden.dtype != torch.float32
                                   or not hidden.is_contiguous()):
            raise ValueError(f"hidden must be a contiguous fp32 [{rows}, {config.dim}] tensor")
        att = torch.empty(rows, config.n_heads * config.head_size)
        call = kernels().llama_paged_attend
        for index, block in enumerate(self.blocks):
            qkv = product(block.attn_norm(x), block.attn.qkv).contiguous()
            status = call(ctypes.byref(self._struct), index, rows, positions.data_ptr(), tables.data_ptr(),
                          tables.shape[2], self.pool.block_size, self.pool.num_blocks, qkv.data_ptr(),
                          att.data_ptr(), self._arena)
            if status:
                raise (MemoryError if status == -1 else ValueError)(f"the hybrid step's attention "
                                                                    f"{ERRORS.get(status, status)}")
            out = product(att, block.attn.o)
            x = x + (block.post_attn_norm(out) if block.post_norms else out)
            gate, up = product(block.mlp_norm(x), block.mlp.gate_up).split(config.ffn_size, dim=-1)
            out = product(block.mlp.activation(gate) * up, block.mlp.down)
            x = x + (block.post_mlp_norm(out) if block.post_norms else out)
        normed = self.model.norm(x)
        if hidden is not None:
            hidden.copy_(normed)
        if logit_rows is not None:
            normed = normed[torch.tensor(logit_rows, dtype=torch.long)]
        return product(normed, self.model.lm_head)


def hybrid_step_for(model: Decoder, pool, max_rows: int) -> Optional[HybridDecodeStep]:
    """The hybrid step for `model` on `pool`, or None where `why_not_hybrid` names a reason."""
    return HybridDecodeStep(model, pool, max_rows) if why_not_hybrid(model, pool) is None else None
