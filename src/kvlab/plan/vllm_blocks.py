"""What vLLM would log at start-up for a KV budget, term by term, and what one long request really holds.

The groups and pages are kvlab.plan.vllm_groups'; this adds the rest of
`vllm/v1/core/kv_cache_utils.py` (0.32.0 as installed; main at 001cabc1be16 for 0.19):

- `get_kv_cache_config_from_groups`: num_blocks = available // bytes per block, a block being
  the largest group's pages (group_size x page for several groups, the sum of all pages for one).
- `get_max_concurrency_for_kv_cache_config`: a request of max_model_len tokens needs, per group,
  its spec's `max_memory_usage_bytes` in pages (full: every token; sliding: window - 1 +
  in-flight tokens, plus one block; chunked: chunk + in-flight tokens, all capped at
  max_model_len); concurrency = num_blocks / their sum.
- The logged size: 0.32's `get_kv_cache_capacity` logs int(concurrency x max_model_len) on the
  concurrency's line; 0.19's `_report_kv_cache_config` logged num_blocks // groups x the smallest
  block size on a line of its own (kvlab.plan.vllm_versions says which release does which).
- `_check_enough_kv_cache_memory` / `_estimate_max_model_len_from_groups`: vLLM refuses to start
  when one request of max_model_len does not fit (0.32 first holds back the null block) and
  names the longest max_model_len that would; `vllm_max_model_len` is that figure.

Windowed layers free the blocks that leave their window (sliding: tokens before T - window + 1;
chunked: tokens before the current chunk), so a long request holds fewer blocks than the logged
figures assume: `request_*` is that real usage at `context` tokens.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from kvlab.plan.capacity import CacheFormats
from kvlab.plan.errors import PlanError
from kvlab.plan.vllm_groups import KVGroup, kv_groups
from kvlab.plan.vllm_versions import DEFAULT_VERSION, VllmRelease, release

GIB = 2**30
DEVICES = ("cuda", "cpu")
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}
CPU_MLA_BLOCK_SIZE = 16  # vLLM's CPU platform forces it for MLA models: its MLA decode kernel compiles for 16 only
LONGEST = 1 << 40


def default_block_size(spec, device: str) -> int:
    """vLLM's tokens per block on `device` for this model."""
    return CPU_MLA_BLOCK_SIZE if device == "cpu" and spec.has_mla else DEFAULT_BLOCK_SIZE[device]


def gib_text(num_bytes: int, vllm: VllmRelease) -> str:
    """GiB as `release` prints them: 0.32's `format_gib` rounds to 2 places and drops zeros; 0.19 printed %.2f."""
    return f"{round(num_bytes / GIB, 2)}" if vllm.tokens_from_concurrency else f"{num_bytes / GIB:.2f}"


def pages_per_request(groups: list[KVGroup], max_model_len: int, in_flight: int) -> int:
    return sum(group.peak_blocks(max_model_len, in_flight) for group in groups)


def vllm_capacity(spec, available_bytes: int, max_model_len: int, formats: CacheFormats,
                  block_size: Optional[int] = None, tensor_parallel: int = 1, device: str = "cuda",
                  max_num_batched_tokens: int = 2048, context: Optional[int] = None,
                  hybrid: bool = True, version: str = DEFAULT_VERSION) -> dict[str, Any]:
    """vLLM's block arithmetic, its start-up log lines with their decomposition, and one request's real usage."""
    if device not in DEVICES:
        raise PlanError(f"--vllm-device must be one of {', '.join(DEVICES)}, got {device!r}")
    vllm = release(version)
    block_size = block_size or default_block_size(spec, device)
    groups = kv_groups(spec, formats, block_size, tensor_parallel, hybrid, vllm)
    group_size = max(group.layers for group in groups)
    one_group = len(groups) == 1
    block_bytes = groups[0].page_bytes if one_group else groups[0].page_bytes * group_size
    num_blocks = max(0, available_bytes) // block_bytes
    in_flight = vllm.in_flight_tokens(device, max_num_batched_tokens)
    peaks = [group.peak_blocks(max_model_len, in_flight) for group in groups]
    per_request = sum(peaks)
    concurrency = num_blocks / per_request
    smallest_block = min(group.block_size for group in groups)
    if vllm.tokens_from_concurrency:
        tokens = int(concurrency * max_model_len)
        tokens_formula = f"int({concurrency:.4f} x {max_model_len:,})"
    else:
        tokens = num_blocks // len(groups) * smallest_block
        tokens_formula = f"{num_blocks:,} // {len(groups)} groups x {smallest_block}"
    context = max_model_len if context is None else context
    held = sum(group.held_blocks(context) for group in groups)
    reserve = block_bytes if vllm.tokens_from_concurrency else 0  # 0.32 checks against all but the null block
    label = "GPU" if device == "cuda" else "CPU"
    size = f"{label} KV cache size: {tokens:,} tokens"
    rate = f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    result = {
        "vllm_version": vllm.name,
        "device": device,
        "hybrid_kv_cache_manager": hybrid,
        "block_size": block_size,
        "block_bytes_all_layers": block_bytes,
        "kv_cache_groups": [dict(kind=g.kind, window=g.window, layers=g.layers, block_size=g.block_size,
                                 page_bytes=g.page_bytes, padded=g.padded, pages_per_request=peak)
                            for g, peak in zip(groups, peaks)],
        "group_size": 1 if one_group else group_size,
        "padding_layers": 0 if one_group else sum(group_size - group.layers for group in groups),
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_in_flight_tokens": in_flight,
        "num_gpu_blocks": num_blocks,
        "pages_per_request": per_request,
        "max_concurrency": concurrency,
        "gpu_kv_cache_tokens": tokens,
        "tokens_formula": tokens_formula,
        "vllm_max_model_len": longest_model_len(groups, max(0, available_bytes - reserve) // block_bytes, 1,
                                                in_flight),
        "request_context": context,
        "request_blocks": held,
        "request_bytes": held * block_bytes,
        "requests_that_fit": num_blocks // held if held else None,
        "log_lines": [f"Available KV cache memory: {gib_text(available_bytes, vllm)} GiB"]
                     + ([f"{size}, {rate}"] if vllm.one_line else [size, rate]),
    }
    result["decomposition"] = decomposition(result, groups, available_bytes, max_model_len)
    return result


def longest_model_len(groups: list[KVGroup], blocks: int, batch: int, in_flight: int) -> Optional[int]:
    """The longest max_model_len at which `batch` requests' peak pages fit in `blocks` (0: none; None: any,
    when every layer is windowed). vLLM's `_estimate_max_model_len_from_groups` is the batch-1 case."""
    def fits(length: int) -> bool:
        return batch * pages_per_request(groups, length, in_flight) <= blocks

    if not fits(1):
        return 0
    if fits(LONGEST):
        return None
    low, high = 1, LONGEST
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def vllm_longest_context(spec, available_bytes: int, batch: int, formats: CacheFormats,
                         block_size: Optional[int] = None, tensor_parallel: int = 1, device: str = "cuda",
                         max_num_batched_tokens: int = 2048, hybrid: bool = True,
                         version: str = DEFAULT_VERSION) -> Optional[int]:
    """The inverse question under vLLM's arithmetic: the longest context `batch` concurrent requests can each
    reach, in the blocks `available_bytes` buys (a max_model_len at which vLLM's concurrency is at least `batch`)."""
    vllm = release(version)
    groups = kv_groups(spec, formats, block_size or DEFAULT_BLOCK_SIZE[device], tensor_parallel, hybrid, vllm)
    block_bytes = groups[0].page_bytes * (max(g.layers for g in groups) if len(groups) > 1 else 1)
    blocks = max(0, available_bytes) // block_bytes
    return longest_model_len(groups, blocks, batch, vllm.in_flight_tokens(device, max_num_batched_tokens))


def decomposition(v: dict[str, Any], groups: list[KVGroup], available: int, max_model_len: int) -> list[str]:
    """The logged figures written out term by term: groups, pages, blocks, pages per request, the formula."""
    kinds: dict[tuple[str, int, bool], list[int]] = {}
    for g in groups:
        kinds.setdefault((g.label, g.block_size, g.padded), []).append(g.layers)
    described = "; ".join(f"{len(sizes)} x {label}" if len(sizes) > 1 else label for (label, _, _), sizes in
                          kinds.items()) if len(groups) > 1 else groups[0].label
    blocks_of = ", ".join(f"{label} {size}-token{' padded' if padded else ''}" for label, size, padded in kinds)
    page = groups[0].page_bytes
    if len(groups) == 1:
        block = (f"1 group ({described}, {groups[0].layers} layers, {groups[0].block_size}-token blocks): a block is "
                 f"every layer's page, {v['block_bytes_all_layers']:,} B")
    else:
        block = (f"{len(groups)} groups ({described}) of {v['group_size']} layers, {v['padding_layers']} padding; "
                 f"blocks: {blocks_of}; a block is a {page:,} B page in each of {v['group_size']} layers = "
                 f"{v['block_bytes_all_layers']:,} B")
    formulas = Counter(g.peak_formula(max_model_len, v["max_in_flight_tokens"]) for g in groups)
    peaks = " + ".join(f"{count} x ({formula})" if count > 1 else formula for formula, count in formulas.items())
    return [
        block,
        f"num_blocks = {available:,} B // {v['block_bytes_all_layers']:,} B = {v['num_gpu_blocks']:,}",
        f"pages per request at max_model_len {max_model_len:,} (in-flight tokens "
        f"{v['max_in_flight_tokens']:,}): {peaks} = {v['pages_per_request']:,}",
        f"concurrency = {v['num_gpu_blocks']:,} / {v['pages_per_request']:,} = {v['max_concurrency']:.2f}x; "
        f"logged tokens = {v['tokens_formula']} = {v['gpu_kv_cache_tokens']:,}",
    ]
