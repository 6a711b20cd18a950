"""Token-row storage for one side (K or V, or an MLA latent) of one layer.

A codec says what a token row is made of; these say where rows live. `PreallocatedRows`
fixes its buffers at `capacity` tokens up front (a static cache: stable addresses, the plan's
bytes for max_tokens). `GrowingRows` holds exactly the rows written so far (the plan's bytes
for the tokens held), at the price of a copy per append.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator

import torch
from torch import Tensor

from kvlab.cache.codecs import RowCodec


class PreallocatedRows:
    """Buffers [*lead, capacity, width] per codec field, filled front to back."""

    def __init__(self, codec: RowCodec, lead: tuple[int, ...], capacity: int, device: torch.device) -> None:
        self.codec = codec
        self.buffers = {name: torch.zeros(*lead, capacity, width, dtype=dtype, device=device)
                        for name, (width, dtype) in codec.fields().items()}

    def write(self, start: int, x: Tensor) -> None:
        """Encode rows x [*lead, T, dim] into token slots start..start+T-1."""
        for name, field in self.codec.encode(x).items():
            self.buffers[name][..., start:start + field.shape[-2], :] = field

    def read(self, end: int, dtype: torch.dtype) -> Tensor:
        """Decode token slots 0..end-1."""
        return self.codec.decode({name: buf[..., :end, :] for name, buf in self.buffers.items()}, dtype)

    def tensors(self) -> Iterator[Tensor]:
        return iter(self.buffers.values())


class GrowingRows:
    """Exactly the rows written so far, one tensor per codec field (empty until the first write)."""

    def __init__(self, codec: RowCodec, lead: tuple[int, ...], device: torch.device) -> None:
        self.codec = codec
        self.lead = lead
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.fields = {name: torch.empty(*self.lead, 0, width, dtype=dtype, device=self.device)
                       for name, (width, dtype) in self.codec.fields().items()}

    def append(self, x: Tensor) -> None:
        """Encode rows x [*lead, T, dim] after the rows already held."""
        for name, field in self.codec.encode(x).items():
            self.fields[name] = torch.cat([self.fields[name], field.to(self.device)], dim=-2)

    def read(self, dtype: torch.dtype) -> Tensor:
        return self.codec.decode(self.fields, dtype)

    def tensors(self) -> Iterator[Tensor]:
        return iter(self.fields.values())


class GrowingKV:
    """A cache's storage as one GrowingRows of K and one of V per layer (self.k_rows, self.v_rows):
    the store, load, tensor listing and clearing that every grow-as-you-go cache shares. Mixed in
    before KVCache by the quantised, KVQuant and sinks + window caches."""

    k_rows: list[GrowingRows]
    v_rows: list[GrowingRows]
    compute_dtype: torch.dtype

    def _store(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        self.k_rows[layer].append(k)
        self.v_rows[layer].append(v)

    def _load(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        return self.k_rows[layer].read(self.compute_dtype), self.v_rows[layer].read(self.compute_dtype)

    def tensors(self) -> Iterator[Tensor]:
        return chain.from_iterable(rows.tensors() for rows in self.k_rows + self.v_rows)

    def _clear(self) -> None:
        for rows in self.k_rows + self.v_rows:
            rows.clear()
