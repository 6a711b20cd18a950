"""vLLM's KV-cache groups: which layers share a block table, and how big one block is.

Read from `vllm/v1/core/kv_cache_utils.py` (0.32.0 and main at 001cabc1be16):

- `get_kv_cache_groups`: when every layer needs the same token slots (all full attention, or
  one window everywhere) all layers form one group and a block costs the sum of their pages
  (`_get_kv_cache_groups_uniform_spec` / `_uniform_type`).
- Otherwise `unify_kv_cache_spec_page_size` enlarges each smaller page to the largest by giving
  that layer proportionally more tokens per block; a page that does not divide the largest is,
  in 0.32, padded to it (attention layers other than MLA), and refused before.
- `_get_kv_cache_groups_uniform_page_size` splits the layers of each kind into groups of equal
  size: the smallest kind's count, or the largest's when the counts differ by less than 1.5x,
  with `layers[i::num_groups]` to the i-th group and short groups padded; a block id is then a
  page in each of `group_size` layers (`_get_kv_cache_bytes_per_block`).
- `--disable-hybrid-kv-cache-manager` (`unify_hybrid_kv_cache_specs`) allocates sliding and
  chunked layers as full attention: one group, nothing freed.

Pages are counted from kvlab's exact per-layer bytes (`layer_kv_bytes`), so any KV dtype the
planner knows (and vLLM has) gives vLLM's page. Block-stride alignment (`block_stride_alignment`)
is not modelled: no backend kvlab plans for sets one that changes a page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvlab.plan.capacity import CacheFormats, layer_kv_bytes
from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import KIVI, KVQUANT
from kvlab.plan.spec import CHUNKED, MLA, SLIDING, LayerAttention, ModelSpec
from kvlab.plan.vllm_versions import VllmRelease


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: `layers` layers of one kind sharing a block table."""

    kind: str  # "full" (MLA included), "sliding" or "chunked"
    window: Optional[int]
    block_size: int  # tokens per block in this group (enlarged when its page was smaller)
    page_bytes: int  # one layer's page as allocated (all groups alike when there are several)
    layers: int
    padded: bool = False  # page padded up to the largest (0.32, a page that does not divide it)
    layer_ids: tuple[int, ...] = ()  # the model's layers in this group, in order (kvlab's pool lays itself out so)

    def peak_blocks(self, max_model_len: int, in_flight_tokens: int) -> int:
        """Blocks one request of `max_model_len` tokens can need at once (each spec's `max_memory_usage_bytes`)."""
        if self.kind == SLIDING:
            return _cdiv(min(self.window - 1 + in_flight_tokens, max_model_len), self.block_size) + 1
        if self.kind == CHUNKED:
            return _cdiv(min(self.window + in_flight_tokens, max_model_len), self.block_size)
        return _cdiv(max_model_len, self.block_size)

    def peak_formula(self, max_model_len: int, in_flight_tokens: int) -> str:
        """`peak_blocks` written out, for the printed decomposition."""
        if self.kind == SLIDING:
            return (f"cdiv(min({self.window - 1:,} + {in_flight_tokens:,}, {max_model_len:,}), {self.block_size}) + 1")
        if self.kind == CHUNKED:
            return f"cdiv(min({self.window:,} + {in_flight_tokens:,}, {max_model_len:,}), {self.block_size})"
        return f"cdiv({max_model_len:,}, {self.block_size})"

    def held_blocks(self, tokens: int) -> int:
        """Blocks a request holds once `tokens` tokens are computed, after windowed layers free theirs."""
        if self.kind == SLIDING:
            skipped = max(0, tokens - self.window + 1)
        elif self.kind == CHUNKED:
            skipped = tokens // self.window * self.window
        else:
            skipped = 0
        return _cdiv(tokens, self.block_size) - skipped // self.block_size

    @property
    def label(self) -> str:
        return f"{self.kind} {self.window:,}" if self.window else self.kind


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layer_key(layer: LayerAttention, hybrid: bool) -> tuple[str, Optional[int]]:
    if hybrid and layer.kind in (SLIDING, CHUNKED):
        return layer.kind, layer.window
    return "full", None


def check_vllm_formats(spec: ModelSpec, formats: CacheFormats) -> None:
    """One-line refusals for what vLLM has no cache for."""
    if KIVI in (formats.k.scheme, formats.v.scheme):
        raise PlanError("vLLM has no KIVI cache; use --engine kvlab for kivi2/kivi4")
    if KVQUANT in (formats.k.scheme, formats.v.scheme):
        raise PlanError("vLLM has no KVQuant cache; use --engine kvlab for kvquant3/kvquant4")
    if spec.has_state:
        raise PlanError("--engine vllm does not model linear-attention or state-space layers (vLLM aligns their "
                        "state pages with attention blocks); use --engine kvlab")


def kv_groups(spec: ModelSpec, formats: CacheFormats, block_size: int, tensor_parallel: int,
              hybrid: bool, release: VllmRelease) -> list[KVGroup]:
    """The model's layers grouped as `release`'s allocator groups them (`hybrid=False`: all as full)."""
    check_vllm_formats(spec, formats)
    layers = [(index, _layer_key(layer, hybrid), layer.kind == MLA,
               block_size * layer_kv_bytes(layer, 1, formats, tensor_parallel))
              for index, layer in enumerate(spec.layers) if not layer.kv_shared]  # sharing layers hold no cache
    if not layers:
        raise PlanError("every layer reads another layer's cache; vLLM allocates no KV cache for this model")
    keys = {key for _, key, _, _ in layers}
    if len(keys) == 1:  # one kind everywhere: one group, a block is every layer's page
        (kind, window), = keys
        return [KVGroup(kind, window, block_size, sum(page for _, _, _, page in layers), len(layers),
                        layer_ids=tuple(index for index, _, _, _ in layers))]
    largest = max(page for _, _, _, page in layers)
    kinds: dict[tuple[str, Optional[int], int, bool], list[int]] = {}
    for index, (kind, window), is_mla, page in layers:
        if largest % page == 0:
            key = (kind, window, block_size * (largest // page), False)
        elif release.pads_pages and not is_mla:
            key = (kind, window, block_size, True)
        else:
            why = "the largest must be a multiple of each" if not release.pads_pages else "MLA pages cannot be padded"
            raise PlanError(f"vLLM {release.name} cannot unify page sizes of {page:,} and {largest:,} bytes ({why}); "
                            "no vLLM capacity for this model")
        kinds.setdefault(key, []).append(index)
    counts = [len(members) for members in kinds.values()]
    group_size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for (kind, window, tokens_per_block, padded), members in kinds.items():
        splits = _cdiv(len(members), group_size)
        for index in range(splits):
            ids = tuple(members[index::splits])  # layers[i::num_groups], as vLLM splits them
            groups.append(KVGroup(kind, window, tokens_per_block, largest, len(ids), padded, ids))
    return groups
