"""How an engine is put together from a model and its EngineConfig, in the order the parts depend on
each other: the KV budget, the speculative proposer's weights, the refusals of combinations that cannot
run, the pool's size (kvlab.plan's arithmetic, as `kvlab plan --engine`), the pool and its block manager,
the scheduler, and the step that runs the model (the C paged step where the model and pool allow).

It lives apart from the engine loop (kvlab.engine.engine) so the loop reads in one sitting: requests in,
steps out. Every refusal here is a one-line RequestError raised before the pool is allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from kvlab.cache.base import model_dtype_name
from kvlab.cache.pool import KVPool
from kvlab.engine.block_manager import BlockManager
from kvlab.engine.config import EngineConfig
from kvlab.engine.errors import RequestError
from kvlab.engine.memory_budget import available_memory_bytes, utilization_budget
from kvlab.engine.runner import ModelRunner
from kvlab.engine.scheduler import Scheduler, SchedulerConfig
from kvlab.engine.speculative import SpeculativeConfig
from kvlab.plan.capacity import cache_formats
from kvlab.plan.kv_formats import KIVI, KVQUANT
from kvlab.plan.pool_capacity import engine_capacity, uses_seats
from kvlab.plan.speculative import shared_pool_blocks


def shared_capacity(target, draft, budget: int, max_model_len: int, formats, block_size: int) -> dict:
    """The pool's blocks and start-up lines when each block holds the target's and the draft's K/V."""
    blocks, target_block, draft_block = shared_pool_blocks(target, draft, budget, formats, block_size)
    tokens = blocks * block_size
    return {"num_gpu_blocks": blocks, "block_bytes_all_layers": target_block + draft_block,
            "log_lines": [f"Available KV cache memory: {budget / 2**30:.2f} GiB",
                          f"CPU KV cache size: {tokens:,} tokens (each block holds the target's and the draft's K/V)",
                          f"Maximum concurrency for {max_model_len:,} tokens per request: {tokens / max_model_len:.2f}x"]}


def kv_budget(config: EngineConfig) -> int:
    """Bytes for the pool: --kv-cache-memory, else vLLM's CPU reading of --gpu-memory-utilization
    (kvlab.engine.memory_budget), else a share of the machine's available memory."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    if config.gpu_memory_utilization is not None:
        return utilization_budget(config.gpu_memory_utilization, available_memory_bytes())
    return int(config.kv_cache_memory_fraction * available_memory_bytes())


def proposer_weights(speculative: Optional[SpeculativeConfig], mc):
    """(draft model, draft head) that the speculative config names, each None where it names none; a draft of
    another vocabulary, a head trained for another target or asked for more tokens than it has: one line."""
    draft = head = None
    if speculative is not None and speculative.method == "draft_model":
        from kvlab.engine.llm import load_for_engine
        draft, _ = load_for_engine(os.path.expanduser(speculative.model), "dense")
        if draft.config.vocab_size != mc.vocab_size:
            raise RequestError(f"the draft's vocabulary ({draft.config.vocab_size}) is not the target's "
                               f"({mc.vocab_size}): it must share the tokenizer", "speculative_config")
    if speculative is not None and speculative.method in ("eagle", "medusa"):
        from kvlab.nn.draft_head import load_draft_head
        head = load_draft_head(os.path.expanduser(speculative.model), mc,  # another target's: one line
                               f"kvlab-{speculative.method}-head")
        heads = getattr(head.config, "num_heads", None) if speculative.method == "medusa" else None
        if heads is not None and speculative.num_speculative_tokens > heads:
            raise RequestError(f"num_speculative_tokens={speculative.num_speculative_tokens} but the Medusa "
                               f"head set at {speculative.model} has {heads} heads", "speculative_config")
    return draft, head


def refuse_combinations(config: EngineConfig, formats, speculative: Optional[SpeculativeConfig]) -> None:
    """The settings that cannot run together, refused in one line each."""
    windowed = config.kv_window is not None
    if windowed and speculative is not None:
        raise RequestError("--kv-window with speculative decoding is not supported yet", "kv_window")
    # KIVI and KVQuant keep state per seat (kvlab.cache.kivi_pool, kvquant_pool): a KIVI residual, KVQuant's
    # sinks and key outliers, which a rejected draft token would have to roll back
    if uses_seats(formats) and speculative is not None:
        raise RequestError(f"{formats.k.name} pools keep per-sequence state in seats; speculative decoding is not "
                           "supported with them", "kv_cache_dtype")
    if formats.k.scheme == KVQUANT and windowed and config.sink_tokens:
        raise RequestError(f"{formats.k.name} keeps its own first tokens in fp16; --sink-tokens is not supported "
                           "with it (--kv-window alone is)", "sink_tokens")
    if formats.k.scheme == KIVI and windowed and config.kv_window < formats.k.residual + formats.k.group_size:
        raise RequestError(f"--kv-window {config.kv_window} is narrower than {formats.k.name}'s full-precision "
                           f"residual of {formats.k.residual + formats.k.group_size} tokens", "kv_window")


def calibration_for(config: EngineConfig, formats, mc):
    """KVQuant's calibration for this model (None for other formats); a missing or mismatched file is one line."""
    if formats.k.scheme != KVQUANT:
        return None
    if not config.kv_calibration:
        raise RequestError(f"{formats.k.name} needs a KVQuant calibration: give --kv-calibration FILE "
                           "(`kvlab calibrate-kv MODEL --data FILE` writes one beside the model)", "kv_calibration")
    from kvlab.cache.kvquant_calibration import load_calibration
    return load_calibration(config.kv_calibration, mc)


def capacity_for(config: EngineConfig, mc, draft, head, speculative, formats, budget: int, max_model_len: int,
                 seats: int) -> dict:
    """The pool's blocks and vLLM's start-up lines for it: vLLM's CPU backend's arithmetic at our block size;
    with a draft model every block holds both models' K/V (kvlab.plan.speculative, as `kvlab plan --draft`)."""
    if draft is None:
        spec = mc.to_plan_spec()
        if config.kv_window is not None:
            spec = spec.with_kv_window(config.kv_window, config.sink_tokens)
        capacity = engine_capacity(spec, budget, max_model_len, formats, config.block_size, seats,
                                   config.max_num_batched_tokens)
    else:
        capacity = shared_capacity(mc.to_plan_spec(), draft.config.to_plan_spec(), budget, max_model_len, formats,
                                   config.block_size)
    if head is not None:  # no K/V of its own: each running sequence keeps `window` hidden states
        window = getattr(head.config, "window", 1)
        kind = "EAGLE head" if speculative.method == "eagle" else f"Medusa heads ({head.config.num_heads})"
        capacity["log_lines"].append(
            f"{kind}: no KV cache; {window} hidden states ({window * mc.dim * 4:,} B) "
            f"per running sequence, {head.config.param_count() / 1e6:.1f}M parameters, "
            f"draft vocabulary {head.config.draft_vocab:,}")
    if capacity["num_gpu_blocks"] < 1:
        raise RequestError(f"a KV cache budget of {budget:,} B holds no {config.block_size}-token block "
                           f"({capacity['block_bytes_all_layers']:,} B); raise --kv-cache-memory")
    if draft is not None and any(layer is not None for layer in mc.sliding_windows):
        raise RequestError("a draft model shares the pool's blocks with a target of one KV group; "
                           f"{mc.name} has sliding layers", "speculative_config")
    return capacity


def c_steps(model, pool: KVPool, draft, draft_pool: Optional[KVPool], config: EngineConfig):
    """(the target's C paged step, the draft's, the draft as it will run): None where the C step does not apply."""
    paged_step = draft_step = None
    # the C step reads keys rotated when written, or a KVQuant pool's pre-RoPE keys (rotated after decoding)
    if config.paged_step and (not pool.pre_rope or pool.kvquant is not None):
        from kvlab.nn.paged_decode import paged_step_for
        paged_step = paged_step_for(model, pool, config.max_num_seqs)
        if draft is not None and paged_step is not None and draft.packing == "dense" and not draft.config.bias:
            from kvlab.nn.pack import pack_q8_0  # a trained draft is dense: Q8_0 lets the C step run it
            packed = pack_q8_0(draft)
            draft_step = paged_step_for(packed, draft_pool, config.max_num_seqs)
            draft = packed if draft_step is not None else draft
    return paged_step, draft_step, draft


@dataclass
class EngineParts:
    """What `build` puts together, for the engine loop to hold."""

    max_model_len: int
    speculative: Optional[SpeculativeConfig]
    capacity: dict
    pool: KVPool
    blocks: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    decode_path: str


def build(model, config: EngineConfig) -> EngineParts:
    """The engine's parts for `model` under `config`, or a one-line RequestError before any pool is allocated."""
    mc = model.config
    if config.max_model_len and config.max_model_len > mc.max_seq_len:
        raise RequestError(f"--max-model-len {config.max_model_len} exceeds the model's {mc.max_seq_len} tokens")
    max_model_len = min(config.max_model_len or mc.max_seq_len, mc.max_seq_len)
    budget = kv_budget(config)
    formats = cache_formats(config.kv_cache_dtype, model_dtype=model_dtype_name(model.dtype))
    speculative = SpeculativeConfig.parse(config.speculative_config)
    draft, head = proposer_weights(speculative, mc)
    refuse_combinations(config, formats, speculative)
    seated = uses_seats(formats)
    seats = config.max_num_seqs if seated else 0
    calibration = calibration_for(config, formats, mc)
    capacity = capacity_for(config, mc, draft, head, speculative, formats, budget, max_model_len, seats)
    num_blocks = capacity["num_gpu_blocks"]
    pool = KVPool.for_model(mc, num_blocks, config.block_size, config.kv_cache_dtype, model.dtype,
                            kv_window=config.kv_window, sink_tokens=config.sink_tokens, seats=seats,
                            calibration=calibration, max_tokens=max_model_len, pre_rope=config.pre_rope_keys)
    draft_pool = KVPool.for_model(draft.config, num_blocks, config.block_size, config.kv_cache_dtype) \
        if draft is not None else None
    # a KIVI pool's blocks hold what was quantised when they were written, which depends on the
    # sequence's length then: a prefix computed in another sequence is not the same bytes; a KVQuant
    # prefix's sinks and key outliers sit in the seat of the sequence that computed it
    blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching and not seated, pool.groups,
                          seats)
    lookahead = speculative.num_speculative_tokens if speculative else 0
    scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                          config.max_wait_ms, lookahead), blocks)
    paged_step, draft_step, draft = c_steps(model, pool, draft, draft_pool, config)
    runner = ModelRunner(model, pool, config.seed, paged_step, speculative, draft, draft_pool, max_model_len,
                         draft_step, head)
    return EngineParts(max_model_len, speculative, capacity, pool, blocks, scheduler, runner,
                       "fused C step" if paged_step is not None else "module by module")


__all__ = ["EngineParts", "build", "kv_budget", "shared_capacity"]
