"""A KVQuant pool (kvlab.cache.kvquant_pool.KVQuantPlanes) described to the C step (csrc/kvquant.h).

The C step writes and attends over a KVQuant pool in place (csrc/kvquant_attend.h): it needs every
layer's tensors (codes, outlier counts, value scales and outliers, the seats' sinks and key
outliers, the codebooks and the keys' channel ranges) and, per step, each row's seat, since a
sequence's sinks and key outliers live in its seat rather than in its blocks. `kvquant_struct`
builds the descriptor once; `set_seats` points it at the step's seats before each call.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvlab.nn.c_abi import KVQuantCache, KVQuantLayer
from kvlab.nn.model import Decoder
from kvlab.nn.rope import INTERLEAVED
from kvlab.plan.kv_formats import outliers_per_row


def why_not_kvquant(pool) -> Optional[str]:
    """None when the C step can run the KVQuant pool `pool`, else the reason (why_not_paged checked the model,
    the pool's shape, windows and compute dtype before asking)."""
    planes = pool.kvquant
    if planes.bits not in (3, 4) or planes.dim >= 256:
        return "the C step runs 3- and 4-bit KVQuant rows of fewer than 256 channels (one-byte counts and indices)"
    return None


def _tensor(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError("a KVQuant pool tensor the C step writes must be contiguous")
    return t.data_ptr()


def half_style_tables(model: Decoder) -> bool:
    """Whether every layer's RoPE tables are [cos, cos] and [-sin, sin] halves (kvlab.nn.rope's half style):
    the C step then rotates keys by a recurrence over positions instead of reading a table row per key."""
    config = model.config
    if getattr(model.rope, "style", None) == INTERLEAVED or config.head_size % 16:
        return False
    half = config.head_size // 2
    tables = {id(rope): rope for rope in (model.rope_for(layer) for layer in range(config.n_layers))}
    return all(rope.cos.shape[-1] == config.head_size and torch.equal(rope.cos[:, :half], rope.cos[:, half:])
               and torch.equal(rope.sin[:, :half], -rope.sin[:, half:]) for rope in tables.values())


def kvquant_struct(pool, num_layers: Optional[int] = None, rope_halves: bool = False) -> tuple[KVQuantCache, list]:
    """The C descriptor of `pool`'s KVQuant tensors (its first `num_layers` layers), and what must outlive it;
    `rope_halves` is half_style_tables(model)."""
    planes = pool.kvquant
    keep = []
    layers = []
    for layer in range(num_layers or pool.num_layers):
        keys, values, fields = planes.keys[layer], planes.values[layer], planes.v_fields[layer]
        constants = [keys.codebook.contiguous(), values.codebook.contiguous(), keys.zero.contiguous(),
                     keys.range.contiguous()]
        keep.extend(constants)
        layers.append(KVQuantLayer(
            _tensor(planes.k_codes[layer]), _tensor(planes.k_counts[layer]), _tensor(fields["codes"]),
            _tensor(fields["zero"]), _tensor(fields["scale"]), _tensor(fields["outlier_values"]),
            _tensor(fields["outlier_index"]), _tensor(planes.k_sink[layer]), _tensor(planes.v_sink[layer]),
            _tensor(planes.k_outliers[layer]), _tensor(planes.k_outlier_index[layer]),
            *(t.data_ptr() for t in constants)))
    array = (KVQuantLayer * len(layers))(*layers)
    keep.append(array)
    struct = KVQuantCache(planes.bits, planes.percent, planes.sinks, planes.capacity,
                          outliers_per_row(planes.dim, planes.percent), pool.seats, planes.max_tokens, int(rope_halves),
                          None, array)
    return struct, keep


def set_seats(struct: KVQuantCache, seats: Optional[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    """Point `struct` at the step's seats (int32 [rows]); returns the tensor the call must keep alive."""
    if seats is None:
        raise ValueError("a KVQuant pool's step needs each row's seat (its sinks and key outliers live there)")
    seats = seats.to(torch.int32).reshape(-1).contiguous()
    if seats.numel() != rows:
        raise ValueError(f"{seats.numel()} seats for {rows} rows")
    struct.row_seats = seats.data_ptr()
    return seats
