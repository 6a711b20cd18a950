"""A decode step over the engine's paged pool in one C call, every row at its own position.

A serving batch decodes sequences of different lengths, each with its own block table in
kvlab.cache.KVPool. Driven module by module, such a step pays per layer for Python, the
pool's gather of every sequence's blocks into a dense tensor and its dequantisation; the C
step (csrc/llama_decode.c, `llama_paged_decode_step`) reads and writes the pool's per-layer
tensors in place: row r writes its K/V at block_tables[r][pos // block_size], offset
pos % block_size, and attends over its own blocks, all rows and layers in one call. fp8 and
int8 pools are dequantised inside the attention loop, so at long context they read about
half of fp16's bytes; int4 and int2 pools (GroupCodec's packed codes, with an fp16 scale and
zero per group) likewise (int4 at SmolLM2's 64-channel heads: 36 bytes a head-token against
fp16's 128): where a group is whole 8-byte words (16 int4 channels, 32 int2) each word is
widened once and read as planes of codes against query heads permuted to match (csrc/kv_codecs.h,
packed_word), else each code is widened in its lane. Where the CPU has AVX-512 VNNI,
int8 heads of a multiple of 64 channels (up to 256) with one scale per row skip that widening:
their codes go into integer dot products (csrc/attend_int8.h), so those steps' logits differ
from AVX2's in the last digits (tests hold them to the same tolerance as the module path).
What it writes is what `KVPool.write` writes (the same rounding, the same int8/int4/int2
codes), so the module path, which stays the reference, can run any later step.

A KVQuant pool (kvquant3/kvquant4: codebook rows in blocks, each seat's sinks and key outliers)
runs in C too (csrc/kvquant_attend.h, described by kvlab.nn.kvquant_step): the step writes each
row's pre-RoPE key and value rows as KVQuantPlanes.store does, byte for byte, and rotates keys
after decoding them; each row's seat comes with the batch.

A KIVI pool (kivi4, kivi2: quantised tokens in blocks, the newest in an fp32 ring per seat) runs
in place too (csrc/kivi_attend.h, kvlab.nn.kivi_step): each row also names its sequence's seat,
and the step stores and reads what KiviPlanes stores and reads.

A windowed group (a Gemma 3 sliding layer, or `--kv-window K --sink-tokens S` on any layer) reads
only its window and its sinks: each layer's descriptor carries both (kvlab.cache.kv_groups), and the
blocks the pool has handed back are never read.

An MLA model's pool holds one latent row per token (kvlab.cache.pool: kv_heads 1, no values);
the C step writes each row's latent and RoPE keys there and attends over them absorbed
(csrc/mla_attend.h), in fp32, fp16, bf16 or fp8 pools.

`paged_step_for(model, pool, max_rows)` returns a `PagedDecodeStep`, a callable
(ids [S], StepBatch) -> logits [S, V] for steps where every sequence feeds one token, or
None where `why_not_paged` names a reason (the engine then runs module by module).

Several tokens of one sequence (a speculative verification: the last token and k drafts)
run as several rows that share the sequence's block table, at consecutive positions
(`PagedDecodeStep.feeds`). Within each layer the C step writes every row's K/V before any
row attends, and row r attends over positions 0..positions[r] only, so the row at p + i
sees the K/V of the rows at p..p + i - 1 written in that same layer: exactly causal
attention over the new tokens, with no change to the C step. `num_layers` runs only the
first layers, then the final norm and LM head: the self-draft, writing the same K/V into
those layers' pool tensors as the full model does.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Optional

import torch

from kvlab.cache.codecs import FloatCodec, Fp8Codec, GroupCodec, RowCodec
from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.nn.c_abi import CACHE_DTYPES, CACHE_GROUP_BITS, CACHE_KIVI_BITS, CACHE_KVQUANT, KVPlane
from kvlab.nn.c_model import embed_rows, llama_struct, new_arena, why_not_model
from kvlab.nn.kivi_step import kivi_rows, kivi_sides, why_not_kivi
from kvlab.nn.ggml import address
from kvlab.nn.kernels import kernels
from kvlab.nn.kvquant_step import half_style_tables, kvquant_struct, set_seats, why_not_kvquant
from kvlab.nn.model import Decoder

ERRORS = {-1: "could not allocate its scratch memory", -2: "was handed a position or block outside the model or pool",
          -3: "cannot group these query heads", -4: "cannot run this cache format"}


def _cache_code(codec: RowCodec, head_dim: int) -> Optional[int]:
    """The C step's CACHE_* code for one side's codec, or None where C cannot run it."""
    if type(codec) is FloatCodec and codec.dtype in CACHE_DTYPES:
        return CACHE_DTYPES[codec.dtype]
    if type(codec) is Fp8Codec and codec.dtype in CACHE_DTYPES:
        return CACHE_DTYPES[codec.dtype]
    if type(codec) is GroupCodec and codec.bits in CACHE_GROUP_BITS and \
            (codec.group_size >= head_dim or codec.group_size % 8 == 0):
        return CACHE_GROUP_BITS[codec.bits]
    return None


def why_not_paged(model: Decoder, pool) -> Optional[str]:
    """None when `PagedDecodeStep` can run `model` on `pool`, else the reason it cannot."""
    reason = why_not_model(model)
    if reason is not None:
        return reason
    config = model.config
    if not isinstance(pool, KVPool) or pool.device.type != "cpu":
        return "the cache must be a kvlab.cache.KVPool on the CPU"
    if pool.kivi is not None:
        if any(not _window_fits(pool.group(layer).window, config.window_of(layer)) for layer in range(config.n_layers)):
            return "the pool's windows are not the model's"
        return why_not_kivi(config, pool)
    if pool.is_latent != (config.attention == "mla"):
        return "the pool's rows are not this model's (MLA latents for an MLA model, K/V heads otherwise)"
    if pool.is_latent:
        return _why_not_latent(config, pool)
    if any(not _window_fits(pool.group(layer).window, config.window_of(layer)) for layer in range(config.n_layers)):
        return "the pool's windows are not the model's"
    if (pool.num_layers, pool.kv_heads, pool.k_head_dim, pool.v_head_dim) != \
            (config.n_layers, config.kv_heads, config.head_size, config.head_size):
        return "the pool was not built for this model's layers, KV heads and head dim"
    if pool.compute_dtype != torch.float32:
        return "the pool must hand attention fp32 values, as the C step computes in fp32"
    if pool.kvquant is not None and any(group.window for group in pool.groups):
        return "the C step's KVQuant attention reads every position; under --kv-window its steps run module by module"
    if pool.kvquant is not None:
        return why_not_kvquant(pool)
    codes = [_cache_code(codec, config.head_size) for codec in pool.codecs]
    if codes[0] is None or codes[0] != codes[1] or type(pool.codecs[0]) is not type(pool.codecs[1]) \
            or getattr(pool.codecs[0], "group_size", 0) != getattr(pool.codecs[1], "group_size", 0):
        return (f"the C step runs fp32, fp16, bf16, fp8, int8, int4 and int2 pools (groups of a multiple of 8 "
                f"channels), one format for K and V, not {pool.kv_format.name}")
    return None


def _window_fits(pool_window: Optional[int], model_window: Optional[int]) -> bool:
    """Whether a layer's pool group attends as the model's layer may: its own window, or a narrower one
    (`--kv-window`'s policy, with or without sinks: kvlab.cache.kv_groups.model_groups)."""
    if pool_window == model_window:
        return True
    return pool_window is not None and (model_window is None or pool_window < model_window)


def _why_not_latent(config, pool: KVPool) -> Optional[str]:
    """why_not_paged for an MLA model's latent pool."""
    if any(group.sinks or group.window for group in pool.groups):
        return "the C step's MLA layers attend fully; its steps run module by module under --kv-window"
    width = config.kv_lora_rank + config.rope_key_heads * config.qk_rope_head_dim
    if (pool.num_layers, pool.kv_heads, pool.k_head_dim) != (config.n_layers, 1, width):
        return "the pool was not built for this model's layers and latent rows"
    if pool.compute_dtype != torch.float32:
        return "the pool must hand attention fp32 values, as the C step computes in fp32"
    if type(pool.codecs[0]) not in (FloatCodec, Fp8Codec) or _cache_code(pool.codecs[0], width) is None:
        return f"the C step runs fp32, fp16, bf16 and fp8 latent pools, not {pool.kv_format.name}"
    return None


def _fp8_scales(codec: RowCodec, heads: int) -> Optional[torch.Tensor]:
    """fp8's static scale per KV head as fp32 [heads] (a per-tensor scale repeated), else None."""
    if type(codec) is not Fp8Codec:
        return None
    return torch.as_tensor(codec.scale, dtype=torch.float32).reshape(-1).expand(heads).contiguous()


class PagedDecodeStep:
    """`step(ids [S], batch)` -> logits [S, vocab] for a decode step (`batch.is_decode`) over `pool`.

    Holds the addresses of the model's and the pool's tensors (the pool never moves them);
    do not `.to()` the model while it is in use. Scratch memory is one C arena, grown on
    demand and kept until the step is garbage-collected.
    """

    def __init__(self, model: Decoder, pool: KVPool, max_rows: int, num_layers: Optional[int] = None):
        reason = why_not_paged(model, pool)
        if reason is not None:
            raise ValueError(f"cannot run the paged decode step in C: {reason}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be positive, got {max_rows}")
        self.model, self.pool, self.max_rows = model, pool, max_rows
        heads, codec = pool.kv_heads, pool.codecs[0]
        self._keep = []  # fp8 scale tensors the structs point at
        sides = kivi_sides(pool) if pool.kivi is not None else []
        for layer in range(pool.num_layers if pool.kivi is None else 0):
            if pool.kvquant is not None:  # described by self._kvq below
                sides.append((KVPlane(None, None, None, None), KVPlane(None, None, None, None)))
                continue
            pair = []
            for fields, side_codec in ((pool.k[layer], pool.codecs[0]), (pool.v[layer], pool.codecs[1])):
                if fields is None:  # an MLA pool: the values are the latent, K's row
                    pair.append(KVPlane(None, None, None, None))
                    continue
                scales = _fp8_scales(side_codec, heads)
                if scales is not None:
                    self._keep.append(scales)
                data = fields["codes"] if "codes" in fields else fields["x"]
                pair.append(KVPlane(data.data_ptr(), address(fields.get("scale")), address(fields.get("zero")),
                                    address(scales)))
            sides.append(tuple(pair))
        group_size = codec.group_size if type(codec) is GroupCodec else 0
        code = _cache_code(codec, pool.k_head_dim) if codec is not None else None
        if pool.kivi is not None:
            code, group_size = CACHE_KIVI_BITS[pool.kv_format.bits], pool.kv_format.group_size
        layer_groups = [(pool.group_of[layer], pool.group(layer).window, pool.group(layer).sinks)
                        for layer in range(pool.num_layers)]
        if pool.kvquant is not None:
            code = CACHE_KVQUANT
        self._struct, self._layers = llama_struct(model, sides, code, group_size, num_layers, layer_groups)
        self._kvq = None
        if pool.kvquant is not None:
            self._kvq, kept = kvquant_struct(pool, num_layers, half_style_tables(model))
            self._keep.extend(kept)
            self._struct.kvq = ctypes.addressof(self._kvq)
        if pool.kivi is not None:
            self._struct.kivi_residual, self._struct.kivi_seats = pool.kv_format.residual, pool.seats
        self._arena = new_arena()
        weakref.finalize(self, kernels().kvlab_arena_free, self._arena)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        rows = batch.num_seqs
        if not batch.is_decode or ids.numel() != rows:
            raise ValueError(f"a paged decode step feeds one token per sequence: {ids.numel()} ids for "
                             f"query lengths {batch.query_lens}")
        if rows > self.max_rows:
            raise ValueError(f"{rows} sequences in a step built for at most {self.max_rows}")
        if batch.block_size != self.pool.block_size:
            raise ValueError(f"the batch's blocks hold {batch.block_size} tokens, the pool's {self.pool.block_size}")
        return self._run(ids.reshape(rows), batch.positions, _padded(batch.group_tables),
                         seats=(batch.positions.tolist(), [1] * rows, batch.seats))

    def feeds(self, feeds: list[list[int]], starts: list[int], block_tables: list,
              logit_rows: Optional[list[int]] = None, hidden: Optional[torch.Tensor] = None,
              inputs: Optional[torch.Tensor] = None, seats: Optional[list[int]] = None) -> torch.Tensor:
        """Sequence s feeds tokens feeds[s] at positions starts[s]..: logits [sum of lengths, V], packed in order,
        or only for the packed rows `logit_rows` (ascending) when given: [len(logit_rows), V].

        `block_tables` is each sequence's table, or for a pool of several KV groups one list of
        tables per group. Each token is a row of its own (see the module doc), so a prompt's
        chunk runs here too; blocks must already cover every position. `hidden` (fp32 [rows, dim],
        contiguous) receives every row's final hidden state (after the final norm: what the LM
        head reads). `inputs` (fp32 [rows, dim]) replaces the tokens' embeddings as the rows'
        input (an EAGLE head's fused features); `feeds` then only give the positions. `seats[s]` is
        sequence s's seat: a KVQuant pool keeps its sinks and key outliers there (it must be given), a
        KIVI pool its residual ring (by default 0, 1, ...); other pools ignore it.
        """
        lengths = torch.tensor([len(feed) for feed in feeds])
        ids = torch.tensor([t for feed in feeds for t in feed])
        first = torch.tensor(starts).repeat_interleave(lengths)
        offsets = torch.arange(int(lengths.sum())) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        grouped = block_tables if block_tables and isinstance(block_tables[0][0], list) else [block_tables]
        return self._run(ids, first + offsets, _padded(grouped).repeat_interleave(lengths, dim=1), logit_rows,
                         hidden, inputs, (starts, lengths.tolist(), seats))

    def rows(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: list[list[int]]) -> torch.Tensor:
        """One token per row: ids [R] at positions [R], row r's blocks block_tables[r] (a pool of one
        KV group) -> logits [R, V]."""
        return self._run(ids, positions, _padded([block_tables]))

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
             logit_rows: Optional[list[int]] = None, hidden: Optional[torch.Tensor] = None,
             inputs: Optional[torch.Tensor] = None, seats: Optional[tuple] = None) -> torch.Tensor:
        """`seats`: the sequences' (starts, lengths, seats), which KIVI and KVQuant pools' rows need (by
        default each row a sequence of its own; a KIVI pool then seats them 0, 1, ...; a KVQuant pool refuses)."""
        rows = int(ids.numel())
        starts, lengths, seq_seats = seats if seats is not None else (positions.tolist(), [1] * rows, None)
        if self.pool.kivi is not None:  # read by the C step during this call only
            seq_seats = seq_seats if seq_seats is not None else list(range(len(starts)))
            kivi = kivi_rows(self.pool, starts, lengths, seq_seats)
            self._struct.kivi_rows = kivi.data_ptr()
        if self._kvq is not None:
            row_seats = None if seq_seats is None else torch.tensor(seq_seats).repeat_interleave(torch.tensor(lengths))
            kept_seats = set_seats(self._kvq, row_seats, rows)  # noqa: F841 (alive through the call)
        positions = positions.to(torch.int32).contiguous()
        tables = tables.contiguous()
        dim = self.model.config.dim
        if inputs is not None:  # the C step overwrites its input rows (the residual stream): a copy
            if tuple(inputs.shape) != (rows, dim):
                raise ValueError(f"inputs must be [{rows}, {dim}], got {list(inputs.shape)}")
            x = inputs.to(torch.float32).clone(memory_format=torch.contiguous_format)
        else:
            x = embed_rows(self.model, ids.reshape(rows))
        if hidden is not None and (tuple(hidden.shape) != (rows, dim) or hidden.dtype != torch.float32
                                   or not hidden.is_contiguous()):
            raise ValueError(f"hidden must be a contiguous fp32 [{rows}, {dim}] tensor")
        picks = torch.tensor(logit_rows, dtype=torch.int32) if logit_rows is not None else None
        logits = torch.empty(rows if picks is None else len(picks), self.model.config.vocab_size)
        status = kernels().llama_paged_step(ctypes.byref(self._struct), rows, positions.data_ptr(), tables.data_ptr(),
                                            tables.shape[2], self.pool.block_size, self.pool.num_blocks,
                                            x.data_ptr(), address(picks), logits.shape[0], logits.data_ptr(),
                                            address(hidden), self._arena)
        if status:
            raise (MemoryError if status == -1 else ValueError)(f"the paged decode step {ERRORS.get(status, status)}")
        return logits


def _padded(group_tables: list[list[list[int]]]) -> torch.Tensor:
    """Each KV group's block tables as one int32 tensor [groups, tables, longest], short ones padded
    with block 0 (never read: the C step reads a row's entries up to its position only)."""
    widest = max(len(table) for tables in group_tables for table in tables)
    return torch.tensor([[table + [0] * (widest - len(table)) for table in tables] for tables in group_tables],
                        dtype=torch.int32)


def paged_step_for(model: Decoder, pool, max_rows: int, num_layers: Optional[int] = None) -> Optional[PagedDecodeStep]:
    """The C paged decode step for `model` on `pool`, or None where `why_not_paged` names a reason."""
    return PagedDecodeStep(model, pool, max_rows, num_layers) if why_not_paged(model, pool) is None else None
