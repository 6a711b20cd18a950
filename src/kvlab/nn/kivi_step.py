"""What the C paged step needs to run a KIVI pool (kvlab.cache.kivi_pool) in place: the check, the planes, the rows.

A KIVI pool keeps quantised tokens in blocks (keys per channel over groups of G tokens, values
per token over groups of G channels) and each running sequence's newest tokens in an fp32 ring
at its seat (csrc/kivi_attend.h reads and writes both as KiviPlanes does). Beyond the block
tables the C step needs, per row, its sequence's seat and how many of its tokens sit quantised
once the step's tokens are stored: `kivi_rows`. Attention reads the same packed code rows as
int4/int2 pools, so the same rules apply (value groups of a multiple of 8 channels; read as planes of
whole 8-byte words where rows and groups allow).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvlab.cache.pool import KVPool
from kvlab.nn.c_abi import CACHE_KIVI_BITS, KIVI_MAX_GROUP, KVPlane
from kvlab.plan.kv_formats import kivi_quantised_tokens


def why_not_kivi(config, pool: KVPool) -> Optional[str]:
    """None when the C step can run `config`'s layers on the KIVI pool `pool`, else the reason it cannot."""
    fmt, planes, d = pool.kv_format, pool.kivi, config.head_size
    if fmt.bits not in CACHE_KIVI_BITS or planes.dtype != torch.float32 or pool.compute_dtype != torch.float32:
        return "the C step runs kivi4 and kivi2 pools whose residual and attention are fp32"
    if (pool.num_layers, pool.kv_heads, pool.k_head_dim, pool.v_head_dim) != \
            (config.n_layers, config.kv_heads, d, d):
        return "the pool was not built for this model's layers, KV heads and head dim"
    if any(group.sinks for group in pool.groups):
        return f"the C step's {fmt.name} attention has no sink chunks; --sink-tokens runs module by module"
    if fmt.group_size > KIVI_MAX_GROUP or (fmt.group_size < d and fmt.group_size % 8):
        return (f"the C step runs {fmt.name} groups of a multiple of 8 (or at least the head dim) up to "
                f"{KIVI_MAX_GROUP}, not {fmt.group_size}")
    if pool.seats < 1:
        return f"a {fmt.name} pool needs seats for its residuals"
    return None


def kivi_sides(pool: KVPool) -> list[tuple[KVPlane, KVPlane]]:
    """Each layer's (K, V) planes: codes, scales and zeros in blocks, and the residual ring."""
    p = pool.kivi
    return [(KVPlane(p.k_codes[i].data_ptr(), p.k_scale[i].data_ptr(), p.k_zero[i].data_ptr(), None,
                     p.k_ring[i].data_ptr()),
             KVPlane(p.v_codes[i].data_ptr(), p.v_scale[i].data_ptr(), p.v_zero[i].data_ptr(), None,
                     p.v_ring[i].data_ptr()))
            for i in range(pool.num_layers)]


def kivi_rows(pool: KVPool, starts: Sequence[int], lens: Sequence[int], seats: Sequence[int]) -> torch.Tensor:
    """int32 [rows, 2]: for each row (sequence s feeds lens[s] rows from starts[s]) its seat and the tokens
    of its sequence quantised once the step is stored."""
    fmt = pool.kv_format
    per_seq = [[seat, kivi_quantised_tokens(start + n, fmt.group_size, fmt.residual)]
               for start, n, seat in zip(starts, lens, seats)]
    return torch.tensor(per_seq, dtype=torch.int32).reshape(-1, 2).repeat_interleave(
        torch.tensor(list(lens), dtype=torch.long), dim=0).contiguous()
