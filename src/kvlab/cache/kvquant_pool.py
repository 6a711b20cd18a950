"""KVQuant in the paged pool: one row per token in blocks; the sinks and the key outliers per seat.

KVQuant (kvlab.cache.kvquant) stores a token's head vector as a row of codebook indices: keys
before RoPE over per-channel calibrated ranges, their out-of-range values in a per-sequence pool
of fp16 outliers (compressed sparse rows: each row keeps only its count), values over the row's
own range with their largest values beside them; a sequence's first `sink_tokens` tokens stay
whole in fp16. In the pool:
- position p >= sinks is a row of the sequence's block p // block_size at offset p % block_size:
  per block and head, `block_size` key rows (codes, outlier count) and value rows (codes, fp16
  zero and scale, outliers), kvquant_row_bytes each (a sink position's row is never written);
- each seat (a running sequence's place, handed out by the block manager) keeps the sink
  tokens' K and V in fp16 and the keys' outlier pool of outlier_capacity(max_tokens - sinks)
  slots per head, the plan's count for a sequence of max_tokens;
- the calibration's codebooks and key ranges are held once (the plan's fixed bytes).
Which key values are outliers follows kvlab.cache.kvquant.take_outliers, given the outliers a
sequence already holds (the counts in its blocks; once a sliding group has handed blocks back, a
running count per seat, head and layer kept beside them: bookkeeping, as a block table is), so
the pool holds KVQuantCache's bytes however a step chunks the tokens. Keys come back
un-rotated: attention applies RoPE at their positions after reading.

Layers of different KV groups (Gemma 3's sliding and full layers, kvlab.cache.kv_groups) share
block tensors as the pool's slots do (slot_of); seats stay per layer. A sliding group's blocks
that left its window are handed back (RELEASED): `read_held` reads the held rows, whose key
outliers begin where the count of every earlier row ends.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.cache.base import CacheError
from kvlab.cache.bitpack import pack_bits, unpack_bits
from kvlab.cache.kv_groups import RELEASED
from kvlab.cache.kvquant import KVQuantKeyRows, KVQuantValueCodec, check_calibration, nearest_code, take_outliers
from kvlab.plan.kv_formats import KVQUANT, KVFormat, outlier_capacity


class KVQuantPlanes:
    """Every layer's KVQuant rows in blocks (layer i's in slot slot_of[i]) and every seat's sinks and key
    outliers, for one pool."""

    def __init__(self, fmt: KVFormat, calibration, num_blocks: int, block_size: int, kv_heads: int, dim: int,
                 seats: int, max_tokens: int, device: torch.device, zeroed,
                 slot_of: Optional[Sequence[int]] = None) -> None:
        if fmt.scheme != KVQUANT:
            raise CacheError(f"KVQuantPlanes stores KVQuant formats, not {fmt.name}")
        check_calibration(fmt, calibration)
        if (calibration.kv_heads, calibration.head_dim) != (kv_heads, dim):
            raise CacheError(f"the calibration is for {calibration.kv_heads} KV heads x {calibration.head_dim} "
                             f"dims, the pool holds {kv_heads} x {dim}")
        if seats <= 0:
            raise CacheError(f"a {fmt.name} pool needs seats for its sinks and outliers, got {seats}")
        self.bits, self.percent, self.sinks, self.dim = fmt.bits, fmt.outlier_percent, fmt.sink_tokens, dim
        self.block_size, self.max_tokens = block_size, max_tokens
        self.capacity = outlier_capacity(max(0, max_tokens - self.sinks), dim, self.percent)
        self.keys = [KVQuantKeyRows(dim, self.bits, self.percent, layer.k_codebooks[self.bits], layer.k_zero,
                                    layer.k_range, (1, kv_heads), device) for layer in calibration.layers]
        self.values = [KVQuantValueCodec(dim, self.bits, self.percent, layer.v_codebooks[self.bits])
                       for layer in calibration.layers]
        layers = len(self.keys)
        slot_of = list(slot_of) if slot_of is not None else list(range(layers))
        slots = range(max(slot_of) + 1)

        def planes(shape: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:
            return [zeroed(shape, dtype, device) for _ in range(layers)]

        def slot_planes(shape: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:  # layer i's: its slot's
            made = [zeroed(shape, dtype, device) for _ in slots]
            self._blocks.append(made)
            return [made[slot] for slot in slot_of]

        nb, h = num_blocks, kv_heads
        k0 = self.keys[0]
        self._blocks: list[list[Tensor]] = []
        self.k_codes = slot_planes((nb, h, block_size, k0.codes.shape[-1]), torch.uint8)
        self.k_counts = slot_planes((nb, h, block_size, 1), k0.count_dtype)
        v_slots = [{name: zeroed((nb, h, block_size, width), dtype, device)
                    for name, (width, dtype) in self.values[0].fields().items()} for _ in slots]
        self._blocks.extend([list(fields.values()) for fields in v_slots])
        self.v_fields = [v_slots[slot] for slot in slot_of]
        self.k_used = torch.zeros(layers, seats, h, dtype=torch.long)  # key outliers each seat's sequence holds
        self.k_sink = planes((seats, h, self.sinks, dim), torch.float16)
        self.v_sink = planes((seats, h, self.sinks, dim), torch.float16)
        self.k_outliers = planes((seats, h, self.capacity), torch.float16)
        self.k_outlier_index = planes((seats, h, self.capacity), k0.index_dtype)

    def store(self, layer: int, k: Tensor, v: Tensor, starts: Sequence[int], lens: Sequence[int],
              tables: Sequence[Sequence[int]], seats: Sequence[int]) -> None:
        """Each sequence's new pre-RoPE keys and values (rows of k [N, H, D] and v [N, H, D], packed in
        order) of layer `layer` (the pool's slot: a KVQuant pool is one group of every layer) at positions
        starts[s].., into its blocks `tables[s]` and its seat seats[s]."""
        at = 0
        for start, new, table, seat in zip(starts, lens, tables, seats):
            kn, vn = k[at:at + new].transpose(0, 1), v[at:at + new].transpose(0, 1)  # [H, n, D]
            at += new
            sink = max(0, min(self.sinks - start, new))
            if sink:
                self.k_sink[layer][seat][:, start:start + sink] = kn[:, :sink].to(torch.float16)
                self.v_sink[layer][seat][:, start:start + sink] = vn[:, :sink].to(torch.float16)
            if sink < new:
                self._store_rows(layer, kn[:, sink:], vn[:, sink:], start + sink, table, seat)

    def _store_rows(self, layer: int, k: Tensor, v: Tensor, first: int, table: Sequence[int], seat: int) -> None:
        """Rows of positions first.. (all past the sinks) of one sequence: k, v [H, n, D]."""
        if first + k.shape[1] > self.max_tokens:
            raise CacheError(f"position {first + k.shape[1] - 1} is past the {self.max_tokens} tokens the pool's "
                             f"seats hold key outliers for")
        keys = self.keys[layer]
        blocks, offsets = self._places(table, first, first + k.shape[1])
        before = first - self.sinks
        if RELEASED in list(table[:-(-first // self.block_size)]):  # a sliding group: earlier rows handed back
            used = self.k_used[layer, seat].clone()
        else:  # every earlier row held (what the C step, which keeps no count, writes too)
            counts = self._rows(self.k_counts[layer], self._held(table, first), self.sinks, first)
            used = counts.long().sum(dim=(-2, -1))
        xn = keys.normalise(k[None])[0]  # [H, n, D]
        mask = take_outliers(xn, used, before, self.percent)
        head, row, channel = mask.nonzero(as_tuple=True)  # in row order within each head
        rank = mask.flatten(1).long().cumsum(-1).view_as(mask)[head, row, channel] - 1
        self.k_outliers[layer][seat][head, used[head] + rank] = k[head, row, channel].to(torch.float16)
        self.k_outlier_index[layer][seat][head, used[head] + rank] = channel.to(keys.index_dtype)
        codes = pack_bits(nearest_code(xn.clamp(-1, 1), keys.codebook.float()), self.bits)
        self.k_codes[layer][blocks, :, offsets] = codes.transpose(0, 1)
        self.k_counts[layer][blocks, :, offsets] = mask.sum(-1, keepdim=True).to(keys.count_dtype).transpose(0, 1)
        self.k_used[layer, seat] = used + mask.sum(dim=(-2, -1))
        for name, value in self.values[layer].encode(v).items():
            self.v_fields[layer][name][blocks, :, offsets] = value.transpose(0, 1)

    def _places(self, table: Sequence[int], first: int, end: int) -> tuple[Tensor, Tensor]:
        positions = torch.arange(first, end)
        blocks = torch.as_tensor(list(table), dtype=torch.long)[positions // self.block_size]
        return blocks, positions % self.block_size

    def _held(self, table: Sequence[int], end: int) -> Tensor:
        """The ids of the blocks that hold a sequence's positions 0..end-1."""
        return torch.as_tensor(list(table[:-(-end // self.block_size)]), dtype=torch.long)

    @staticmethod
    def _rows(plane: Tensor, held: Tensor, first: int, end: int) -> Tensor:
        """Rows first..end-1 of the blocks `held` of `plane` (a sequence's, in order): [H, end - first, width]."""
        return plane[held].transpose(0, 1).flatten(1, 2)[:, first:end]

    def read(self, layer: int, table: Sequence[int], seat: int, length: int,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A sequence's first `length` keys (before RoPE) and values [H, length, D] in `dtype`, as
        KVQuantCache returns them: the sinks from the seat, then the rows dequantised; every block held."""
        if RELEASED in list(table[:-(-length // self.block_size)]):
            raise CacheError("the block table has released blocks: use read_held")
        keys, values, _ = self.read_held(layer, table, seat, length, dtype)
        return keys, values

    def read_held(self, layer: int, table: Sequence[int], seat: int, length: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """Like `read`, skipping the blocks handed back (RELEASED, a prefix of a sliding group's table):
        keys (before RoPE) and values [H, held, D] and their positions [held]."""
        sink = min(self.sinks, length)
        k_sink = self.k_sink[layer][seat][:, :sink].to(dtype)
        v_sink = self.v_sink[layer][seat][:, :sink].to(dtype)
        gone = next((b for b in range(-(-length // self.block_size)) if table[b] != RELEASED), 0)
        first = max(self.sinks, gone * self.block_size)  # the first row held in a block
        positions = torch.cat((torch.arange(sink), torch.arange(first, length)))
        if length <= first:
            return k_sink, v_sink, positions
        keys, held = self.keys[layer], self._held(table, length)[gone:]
        codes = self._rows(self.k_codes[layer], held, first - gone * self.block_size, length - gone * self.block_size)
        x = keys.codebook.float()[unpack_bits(codes, self.bits, self.dim)] * keys.range[0].float() \
            + keys.zero[0].float()
        counts = self._rows(self.k_counts[layer], held, first - gone * self.block_size,
                            length - gone * self.block_size).long().squeeze(-1)  # [H, n]
        # the held rows' outliers are the last of the sequence's: they begin after every earlier row's
        earlier = self.k_used[layer, seat] - counts.sum(-1) if gone else torch.zeros(counts.shape[0], dtype=torch.long)
        ends = counts.cumsum(-1) + earlier[:, None]
        begin, used = int((ends[:, 0] - counts[:, 0]).min()), int(ends[:, -1].max())
        if used > begin:
            slot = torch.arange(begin, used).expand(ends.shape[0], used - begin).contiguous()
            row = torch.searchsorted(ends, slot, right=True)
            rows = ends.shape[1]
            index = self.k_outlier_index[layer][seat][:, begin:used].long()
            inside = (slot < ends[:, -1:]) & (slot >= (ends[:, :1] - counts[:, :1]))
            target = torch.where(inside, row * self.dim + index, rows * self.dim)
            values = self.k_outliers[layer][seat][:, begin:used].float()
            x = F.pad(x.flatten(1), (0, 1)).scatter(-1, target, values)[..., :-1].view_as(x)
        fields = {name: self._rows(plane, held, first - gone * self.block_size, length - gone * self.block_size)
                  for name, plane in self.v_fields[layer].items()}
        values = self.values[layer].decode(fields, dtype)
        return torch.cat((k_sink, x.to(dtype)), dim=1), torch.cat((v_sink, values), dim=1), positions

    def tensors(self) -> Iterator[Tensor]:
        constants = chain.from_iterable(rows.constants() for rows in self.keys + self.values)
        return chain(chain.from_iterable(self._blocks), self.k_sink, self.v_sink, self.k_outliers,
                     self.k_outlier_index, constants)
