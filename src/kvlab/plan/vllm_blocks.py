"""What vLLM would log at start-up for the same budget, and what one long request really holds.

The rule is vLLM's hybrid KV-cache manager, read from vLLM main at commit 001cabc1be16
(`vllm/v1/core/kv_cache_utils.py`: `get_kv_cache_groups`, `unify_kv_cache_spec_page_size`,
`_get_kv_cache_groups_uniform_page_size`, `get_kv_cache_config_from_groups`,
`_report_kv_cache_config`, `get_max_concurrency_for_kv_cache_config`;
`vllm/v1/kv_cache_interface.py`: each spec's `page_size_bytes` and `max_memory_usage_bytes`;
`vllm/v1/core/single_type_kv_cache_manager.py`: which blocks a windowed layer frees). Other
releases may differ in details (the 1.5x group-size rule below is recent); the CPU figure is
checked against vLLM 0.32's log on this machine.

- A layer's page is `block_size` tokens of its K and V. When every layer needs the same
  token slots (all full attention, or one window everywhere) all layers form one group and
  a block costs the sum of their pages.
- Otherwise (a hybrid model) the smaller pages are enlarged to the largest one by giving
  those layers proportionally more tokens per block (vLLM refuses when the largest page is
  not a multiple), layers of one kind are split into groups of equal size (the smallest
  kind's count, or the largest's when they differ by less than 1.5x; short groups padded),
  and one block id is a page in each of `group_size` shared tensors.
  num_blocks = available // page // group_size, and the logged "KV cache size" is
  num_blocks // groups x the smallest block size: capacity counted as if every layer kept
  every token, which is why a windowed model's logged size looks like a dense one's.
- Windowed layers free the blocks that leave their window (sliding: tokens before
  T - window + 1; chunked: tokens before the current chunk), so a long request holds far
  fewer blocks than the logged size implies: `request_*` figures are that real usage.
- The logged concurrency divides num_blocks by the blocks one request of max_model_len can
  need at peak: full layers every token, sliding layers window - 1 + max_num_batched_tokens
  tokens plus one block, chunked layers chunk + max_num_batched_tokens tokens.
- With `--disable-hybrid-kv-cache-manager` (vLLM's flag; some releases also turn the manager
  off for chunked local attention unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1)
  every windowed layer is allocated as full attention: one group, no block ever freed.
- vLLM's CPU backend runs the same allocator with 128-token blocks, takes its budget from
  `VLLM_CPU_KVCACHE_SPACE` (GiB) and logs "CPU KV cache size".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvlab.plan.capacity import CacheFormats, layer_kv_bytes
from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import KIVI, KVQUANT
from kvlab.plan.spec import CHUNKED, SLIDING, LayerAttention, ModelSpec

GIB = 2**30
DEVICES = ("cuda", "cpu")
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}
CPU_MLA_BLOCK_SIZE = 16  # vLLM's CPU platform forces it for MLA models: its MLA decode kernel compiles for 16 only


def default_block_size(spec: ModelSpec, device: str) -> int:
    """vLLM's tokens per block on `device` for this model."""
    return CPU_MLA_BLOCK_SIZE if device == "cpu" and spec.has_mla else DEFAULT_BLOCK_SIZE[device]


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: layers of one kind sharing a block table."""

    kind: str  # "full" (MLA included), "sliding" or "chunked"
    window: Optional[int]
    block_size: int
    page_bytes: int
    layers: int

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of `max_model_len` tokens can need at once (vLLM's max_memory_usage_bytes)."""
        if self.kind == SLIDING:
            return _cdiv(min(self.window - 1 + max_num_batched_tokens, max_model_len), self.block_size) + 1
        if self.kind == CHUNKED:
            return _cdiv(min(self.window + max_num_batched_tokens, max_model_len), self.block_size)
        return _cdiv(max_model_len, self.block_size)

    def held_blocks(self, tokens: int) -> int:
        """Blocks a request holds once `tokens` tokens are computed, after windowed layers free theirs."""
        if self.kind == SLIDING:
            skipped = max(0, tokens - self.window + 1)
        elif self.kind == CHUNKED:
            skipped = tokens // self.window * self.window
        else:
            skipped = 0
        return _cdiv(tokens, self.block_size) - skipped // self.block_size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layer_key(layer: LayerAttention) -> tuple[str, Optional[int]]:
    if layer.kind in (SLIDING, CHUNKED):
        return layer.kind, layer.window
    return "full", None


def kv_groups(spec: ModelSpec, formats: CacheFormats, block_size: int, tensor_parallel: int = 1,
              hybrid: bool = True) -> list[KVGroup]:
    """The model's layers grouped as vLLM's hybrid allocator groups them (`hybrid=False`: all as full)."""
    if KIVI in (formats.k.scheme, formats.v.scheme):
        raise PlanError("vLLM has no KIVI cache; use --engine kvlab for kivi2/kivi4")
    if KVQUANT in (formats.k.scheme, formats.v.scheme):
        raise PlanError("vLLM has no KVQuant cache; use --engine kvlab for kvquant3/kvquant4")
    if spec.has_state:
        raise PlanError("--engine vllm does not model linear-attention or state-space layers (vLLM aligns their "
                        "state pages with attention blocks); use --engine kvlab")
    layers = [(_layer_key(layer) if hybrid else ("full", None),
               block_size * layer_kv_bytes(layer, 1, formats, tensor_parallel))
              for layer in spec.layers if not layer.kv_shared]  # KV-sharing layers get no cache of their own
    keys = {key for key, _ in layers}
    if len(keys) == 1:  # one kind everywhere: one group, a block is every layer's page
        (kind, window), = keys
        return [KVGroup(kind, window, block_size, sum(page for _, page in layers), len(layers))]
    largest = max(page for _, page in layers)
    kinds: dict[tuple[str, Optional[int], int], int] = {}
    for (kind, window), page in layers:
        if largest % page:
            raise PlanError(f"vLLM cannot unify page sizes of {page:,} and {largest:,} bytes "
                            "(the largest must be a multiple of each); no vLLM capacity for this model")
        key = (kind, window, block_size * (largest // page))
        kinds[key] = kinds.get(key, 0) + 1
    counts = kinds.values()
    group_size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for (kind, window, tokens_per_block), count in kinds.items():
        for index in range(_cdiv(count, group_size)):
            members = len(range(index, count, _cdiv(count, group_size)))  # layers[i::num_groups], as vLLM splits
            groups.append(KVGroup(kind, window, tokens_per_block, largest, members))
    return groups


def vllm_capacity(spec: ModelSpec, available_bytes: int, max_model_len: int, formats: CacheFormats,
                  block_size: Optional[int] = None, tensor_parallel: int = 1, device: str = "cuda",
                  max_num_batched_tokens: int = 2048, context: Optional[int] = None,
                  hybrid: bool = True) -> dict[str, Any]:
    """vLLM's block arithmetic, its start-up log lines, and one request's real usage at `context` tokens."""
    if device not in DEVICES:
        raise PlanError(f"--vllm-device must be one of {', '.join(DEVICES)}, got {device!r}")
    block_size = block_size or default_block_size(spec, device)
    groups = kv_groups(spec, formats, block_size, tensor_parallel, hybrid)
    group_size = max(group.layers for group in groups)
    one_group = len(groups) == 1
    block_bytes = groups[0].page_bytes if one_group else groups[0].page_bytes * group_size
    num_blocks = max(0, available_bytes) // block_bytes
    tokens = num_blocks // len(groups) * min(group.block_size for group in groups)
    peak = sum(group.peak_blocks(max_model_len, max_num_batched_tokens) for group in groups)
    concurrency = num_blocks / peak
    context = max_model_len if context is None else context
    held = sum(group.held_blocks(context) for group in groups)
    label = "GPU" if device == "cuda" else "CPU"
    padding = sum(group_size - group.layers for group in groups) if not one_group else 0
    return {
        "device": device,
        "hybrid_kv_cache_manager": hybrid,
        "block_size": block_size,
        "block_bytes_all_layers": block_bytes,
        "kv_cache_groups": [dict(kind=g.kind, window=g.window, layers=g.layers, block_size=g.block_size,
                                 page_bytes=g.page_bytes) for g in groups],
        "padding_layers": padding,
        "max_num_batched_tokens": max_num_batched_tokens,
        "num_gpu_blocks": num_blocks,
        "gpu_kv_cache_tokens": tokens,
        "max_concurrency": concurrency,
        "request_context": context,
        "request_blocks": held,
        "request_bytes": held * block_bytes,
        "requests_that_fit": num_blocks // held if held else None,
        "log_lines": [
            f"Available KV cache memory: {available_bytes / GIB:.2f} GiB",
            f"{label} KV cache size: {tokens:,} tokens",
            f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x",
        ],
    }
