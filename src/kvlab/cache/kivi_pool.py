"""KIVI in the paged pool: quantised tokens in blocks, the newest in a full-precision residual per seat.

KIVI (kvlab.cache.kivi) quantises keys per channel over groups of G tokens and values per
token over groups of G channels, and keeps a sequence's newest tokens in full precision until
a whole group of G lies R tokens back: a sequence of T tokens holds
q = kivi_quantised_tokens(T, G, R) tokens quantised and T - q (between R and R + G - 1 once
T >= R) in the residual. In the pool:
- quantised tokens live in the sequence's blocks at their positions (block_size is a multiple
  of G, so a key group never straddles two blocks): per block and head, `block_size` packed
  code rows, block_size / G rows of per-channel key scales and zeros, and per-token value
  scales and zeros, exactly the tensors kvlab.plan.kv_formats counts;
- the residual lives in a ring of R + G rows per seat (a running sequence's place, handed out
  by the block manager) and layer, row p % (R + G) holding position p: the residual spans fewer rows.

Layers of different KV groups (a sliding and a full group, kvlab.cache.kv_groups) share block
tensors as the pool's slots do (slot_of), each with its own ring. A windowed group's blocks
that left the window are handed back (RELEASED in the table); `read_held` reads the rest with
their positions. The window is always wider than the ring (R + G newest tokens): what is
quantised next lies in a held block.

Storing follows KiviCache's order (new tokens join the residual, then the oldest whole groups
beyond R are quantised), and groups start at multiples of G in both, so the pool holds the
same codes as the lab's KiviCache and attention reads the same values.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, Sequence

import torch
from torch import Tensor

from kvlab.cache.base import CacheError
from kvlab.cache.kv_groups import RELEASED
from kvlab.cache.quantize import dequantize_groups, pack_codes, quantize_groups, unpack_codes
from kvlab.plan.kv_formats import KIVI, KVFormat, groups_per_row, kivi_quantised_tokens, packed_row_bytes


class KiviPlanes:
    """Every layer's quantised blocks (layer i's in slot slot_of[i]) and residual ring per seat, for one pool."""

    def __init__(self, fmt: KVFormat, slot_of: Sequence[int], num_blocks: int, block_size: int, kv_heads: int,
                 k_dim: int, v_dim: int, seats: int, dtype: torch.dtype, device: torch.device, zeroed) -> None:
        if fmt.scheme != KIVI:
            raise CacheError(f"KiviPlanes stores KIVI formats, not {fmt.name}")
        if block_size % fmt.group_size:
            raise CacheError(f"a {fmt.name} pool needs blocks of a multiple of its group of {fmt.group_size} "
                             f"tokens, not {block_size}")
        if seats <= 0:
            raise CacheError(f"a {fmt.name} pool needs seats for its residuals, got {seats}")
        self.bits, self.group, self.residual = fmt.bits, fmt.group_size, fmt.residual
        self.block_size, self.k_dim, self.v_dim, self.dtype = block_size, k_dim, v_dim, dtype
        self.ring = fmt.residual + fmt.group_size
        nb, h, g = num_blocks, kv_heads, fmt.group_size

        def blocks(rows: int, width: int, dt: torch.dtype) -> Tensor:
            return zeroed((nb, h, rows, width), dt, device)

        slots = range(max(slot_of) + 1)

        def by_layer(planes: list[Tensor]) -> list[Tensor]:  # layer i's view: its slot's tensor
            return [planes[slot] for slot in slot_of]

        self._blocks = [[blocks(block_size, packed_row_bytes(k_dim, self.bits), torch.uint8) for _ in slots],
                        [blocks(block_size // g, k_dim, torch.float16) for _ in slots],
                        [blocks(block_size // g, k_dim, torch.float16) for _ in slots],
                        [blocks(block_size, packed_row_bytes(v_dim, self.bits), torch.uint8) for _ in slots],
                        [blocks(block_size, groups_per_row(v_dim, g), torch.float16) for _ in slots],
                        [blocks(block_size, groups_per_row(v_dim, g), torch.float16) for _ in slots]]
        self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero = map(by_layer, self._blocks)
        self.k_ring = [zeroed((seats, h, self.ring, k_dim), dtype, device) for _ in slot_of]
        self.v_ring = [zeroed((seats, h, self.ring, v_dim), dtype, device) for _ in slot_of]

    def quantised(self, tokens: int) -> int:
        return kivi_quantised_tokens(tokens, self.group, self.residual)

    def store(self, layer: int, k: Tensor, v: Tensor, starts: Sequence[int], lens: Sequence[int],
              tables: Sequence[Sequence[int]], seats: Sequence[int]) -> None:
        """Sequence s's new keys and values (rows of k [N, H, Dk] and v [N, H, Dv], packed in order) of
        layer `layer` at positions starts[s].., into its blocks `tables[s]` and its residual ring at seats[s]."""
        at = 0
        for start, new, table, seat in zip(starts, lens, tables, seats):
            kn, vn = k[at:at + new].transpose(0, 1).to(self.dtype), v[at:at + new].transpose(0, 1).to(self.dtype)
            at += new
            end = start + new
            first, last = self.quantised(start), self.quantised(end)
            if last > first:  # whole groups that just fell R tokens back: from the ring, then the new rows
                held = torch.arange(first, min(last, start)) % self.ring
                # none of the new rows when the groups end before them (a slice to last - start < 0 would wrap)
                new_rows = slice(max(0, first - start), max(0, last - start))
                keys = torch.cat((self.k_ring[layer][seat][:, held], kn[:, new_rows]), dim=1)
                values = torch.cat((self.v_ring[layer][seat][:, held], vn[:, new_rows]), dim=1)
                self._quantise(layer, keys, values, first, table)
            fresh = torch.arange(max(start, last), end)
            self.k_ring[layer][seat][:, fresh % self.ring] = kn[:, fresh - start]
            self.v_ring[layer][seat][:, fresh % self.ring] = vn[:, fresh - start]

    def _quantise(self, layer: int, keys: Tensor, values: Tensor, first: int, table: Sequence[int]) -> None:
        """Quantise keys/values [H, n, D] of positions first..first + n - 1 (whole groups) into their blocks."""
        for offset in range(0, keys.shape[1], self.group):
            position = first + offset
            block, row = table[position // self.block_size], position % self.block_size
            k = keys[:, offset:offset + self.group]  # [H, G, D]: per channel over the group's tokens
            codes, scale, zero = quantize_groups(k.transpose(1, 2), self.bits, self.group)
            self.k_codes[layer][block, :, row:row + self.group] = pack_codes(codes.transpose(1, 2), self.bits)
            self.k_scale[layer][block, :, row // self.group] = scale[..., 0]
            self.k_zero[layer][block, :, row // self.group] = zero[..., 0]
            codes, scale, zero = quantize_groups(values[:, offset:offset + self.group], self.bits, self.group)
            self.v_codes[layer][block, :, row:row + self.group] = pack_codes(codes, self.bits)
            self.v_scale[layer][block, :, row:row + self.group] = scale
            self.v_zero[layer][block, :, row:row + self.group] = zero

    def read(self, layer: int, table: Sequence[int], seat: int, length: int,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A sequence's first `length` keys and values [H, length, D] of layer `layer`: its quantised tokens
        dequantised, then its residual, in `dtype`; every block must be held."""
        if RELEASED in list(table[:-(-self.quantised(length) // self.block_size)]):
            raise CacheError("the block table has released blocks: use read_held")
        keys, values, _ = self.read_held(layer, table, seat, length, dtype)
        return keys, values

    def read_held(self, layer: int, table: Sequence[int], seat: int, length: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """Like `read`, skipping the blocks handed back (RELEASED): keys and values [H, held, D] and
        their positions [held] (the quantised tokens of the held blocks, then the residual)."""
        q = self.quantised(length)
        logical = [b for b in range(-(-q // self.block_size)) if table[b] != RELEASED]
        keys, values = self._dequantise(layer, torch.as_tensor([table[b] for b in logical], dtype=torch.long), dtype)
        positions = (torch.tensor(logical, dtype=torch.long)[:, None] * self.block_size
                     + torch.arange(self.block_size)[None, :]).flatten()
        keep = positions < q
        ring = torch.arange(q, length)
        return (torch.cat((keys[:, keep], self.k_ring[layer][seat][:, ring % self.ring].to(dtype)), dim=1),
                torch.cat((values[:, keep], self.v_ring[layer][seat][:, ring % self.ring].to(dtype)), dim=1),
                torch.cat((positions[keep], ring)))

    def _dequantise(self, layer: int, used: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Every token of blocks `used` (in order) dequantised: keys and values [H, len(used) x block_size, D]."""
        rows, groups = len(used) * self.block_size, len(used) * self.block_size // self.group

        def gathered(planes: list[Tensor], count: int) -> Tensor:
            return planes[layer][used].transpose(0, 1).flatten(1, 2)[:, :count]

        keys = dequantize_groups(unpack_codes(gathered(self.k_codes, rows), self.bits, self.k_dim).transpose(1, 2),
                                 gathered(self.k_scale, groups).transpose(1, 2),
                                 gathered(self.k_zero, groups).transpose(1, 2), self.group, dtype).transpose(1, 2)
        values = dequantize_groups(unpack_codes(gathered(self.v_codes, rows), self.bits, self.v_dim),
                                   gathered(self.v_scale, rows), gathered(self.v_zero, rows), self.group, dtype)
        return keys, values

    def tensors(self) -> Iterator[Tensor]:
        return chain(chain.from_iterable(self._blocks), self.k_ring, self.v_ring)
