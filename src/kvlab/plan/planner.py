"""Put the formulas together: one request in, one plain dict out (the `--json` object).

The CLI, the chart page and reports all render this dict; none of them computes bytes itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvlab.plan import capacity
from kvlab.plan.draft_heads import DraftHead
from kvlab.plan.errors import PlanError
from kvlab.plan.hardware import Device
from kvlab.plan.kv_formats import model_dtype_bytes
from kvlab.plan.roofline import MEMORY, decode_step, prefill_seconds
from kvlab.plan.spec import CHUNKED, SLIDING, ModelSpec
from kvlab.plan.speculative import expected_speedup, expected_tokens_per_step, shared_pool_blocks, with_draft
from kvlab.plan.vllm_versions import DEFAULT_VERSION, release

VLLM_DEVICES = ("cuda", "cpu")  # kvlab.plan.vllm_blocks.DEVICES; vLLM's modules load only for --engine vllm
from kvlab.plan.weights import active_weight_bytes, weight_bytes


@dataclass
class PlanRequest:
    """Everything a plan depends on besides the model; defaults follow vLLM where it has one."""

    context: int = 4096
    batch: int = 1
    kv_cache_dtype: str = "auto"
    k_dtype: Optional[str] = None
    v_dtype: Optional[str] = None
    model_dtype: str = "fp16"
    kv_group_size: Optional[int] = None
    kivi_residual: Optional[int] = None
    weight_dtype: str = "auto"
    weight_group_size: int = 128
    kv_cache_memory: Optional[int] = None
    device: Optional[Device] = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel: int = 1
    prompt_len: Optional[int] = None
    engine: str = "kvlab"
    block_size: Optional[int] = None  # vLLM's tokens per block: 16 on cuda, 128 on its CPU backend
    vllm_device: str = "cuda"
    max_num_batched_tokens: Optional[int] = None  # vllm serve's default for the card when None
    max_num_seqs: Optional[int] = None  # vllm serve's default for the card when None (sizes the sampler's peak)
    vllm_hybrid: bool = True  # False: vLLM's --disable-hybrid-kv-cache-manager
    vllm_version: str = DEFAULT_VERSION
    # speculative decoding's draft model (its weights and KV count too), or a built-in draft head (its weights)
    draft: Optional[Union[ModelSpec, DraftHead]] = None
    acceptance_rate: Optional[float] = None
    num_speculative_tokens: int = 3
    verify_cost: float = 1.0  # verifying k + 1 tokens, in plain decode steps (kvlab.plan.speculative)
    warnings: list[str] = field(default_factory=list)

    def validate(self) -> None:
        for name in ("context", "batch", "tensor_parallel", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is None and name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
                continue
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.prompt_len is not None and self.prompt_len <= 0:
            raise PlanError(f"--prompt-len must be positive, got {self.prompt_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise PlanError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if self.engine not in ("kvlab", "vllm"):
            raise PlanError(f"--engine must be kvlab or vllm, got {self.engine!r}")
        release(self.vllm_version)
        if self.vllm_device not in VLLM_DEVICES:
            raise PlanError(f"--vllm-device must be one of {', '.join(VLLM_DEVICES)}, got {self.vllm_device!r}")
        if not self.verify_cost > 0:
            raise PlanError(f"--verify-cost must be positive, got {self.verify_cost}")
        recorded = isinstance(self.draft, DraftHead) and self.draft.held_out_agreement is not None
        if self.verify_cost != 1.0 and self.acceptance_rate is None and not recorded:
            raise PlanError("--verify-cost needs --draft MODEL and --acceptance-rate A (it only enters the speed-up)")

    def batch_defaults(self) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs): the flags, else `vllm serve`'s defaults for the card.

        (vLLM's `EngineArgs.get_batch_defaults` for the OpenAI server, by the memory CUDA reports:
        16,384 / 1,024 from 160 GiB (0.32), 8,192 / 1,024 from 70 GiB but A100, else 2,048 / 256;
        the CPU backend 2,048 / 128. The tokens set how much a windowed layer reserves and the
        profile run's activation peak; the sequences, the sampler's.)
        """
        card = self.device
        total = card.vllm_total_bytes if card is not None else 0
        tokens, seqs = release(self.vllm_version).batch_defaults(self.vllm_device, total, card.name if card else "")
        return self.max_num_batched_tokens or tokens, self.max_num_seqs or seqs

    def batched_tokens(self) -> int:
        return self.batch_defaults()[0]

    def formats(self) -> capacity.CacheFormats:
        return capacity.cache_formats(self.kv_cache_dtype, self.k_dtype, self.v_dtype, self.model_dtype,
                                      self.kv_group_size, self.kivi_residual)


def describe_model(spec: ModelSpec) -> dict[str, Any]:
    kinds = sorted({layer.kind for layer in spec.layers})
    first = spec.first_attention
    described = {
        "name": spec.name, "source": spec.source, "layers": spec.num_layers, "attention_kinds": kinds,
        "q_heads": first.q_heads, "kv_heads": first.kv_heads, "head_dim": first.k_head_dim,
        "v_head_dim": first.v_head_dim, "params_total": spec.params_total, "params_active": spec.active_params,
        "params_estimated": spec.params_estimated, "max_position_embeddings": spec.max_context,
        "tied_embeddings": spec.tied_embeddings, "notes": list(spec.notes),
    }
    if spec.weight_format:
        described["weight_format"] = spec.weight_format
    if spec.checkpoint_bytes:
        described["checkpoint_bytes"] = spec.checkpoint_bytes
    windows = sorted({layer.window for layer in spec.layers if layer.kind == SLIDING})
    if windows:
        described["windows"] = windows
        described["windowed_layers"] = sum(1 for layer in spec.layers if layer.kind == SLIDING)
    shapes: dict[tuple[str, int, int], int] = {}
    for layer in spec.layers:
        if not layer.is_state:
            key = (layer.kind, layer.kv_heads, layer.k_head_dim)
            shapes[key] = shapes.get(key, 0) + 1
    if len({(heads, dim) for _, heads, dim in shapes}) > 1:  # Gemma 4: global layers with their own heads and dims
        described["layer_shapes"] = [dict(kind=kind, layers=count, kv_heads=heads, head_dim=dim)
                                     for (kind, heads, dim), count in shapes.items()]
    chunked = sorted({layer.window for layer in spec.layers if layer.kind == CHUNKED})
    if chunked:
        described["chunk_sizes"] = chunked
    shared = sum(1 for layer in spec.layers if layer.kv_shared)
    if shared:
        described["kv_shared_layers"] = shared
    if spec.has_state:
        described["state_layers"] = sum(1 for layer in spec.layers if layer.is_state)
    if spec.has_mla:
        described["kv_lora_rank"] = first.kv_lora_rank
        described["qk_rope_head_dim"] = first.qk_rope_head_dim
        if first.rope_key_heads != 1:
            described["rope_key_heads"] = first.rope_key_heads
    return described


def plan(spec: ModelSpec, request: PlanRequest) -> dict[str, Any]:
    """Every figure for `spec` under `request`, per tensor-parallel rank where it matters."""
    request.validate()
    formats = request.formats()
    tp = request.tensor_parallel
    if spec.max_context is not None and request.context > spec.max_context:
        request.warnings.append(f"context {request.context} exceeds {spec.name}'s stated limit of "
                                f"{spec.max_context} tokens; computing it anyway")
    target = spec
    head = request.draft if isinstance(request.draft, DraftHead) else None
    if head is not None:  # no K/V: the pool is the target's alone
        if request.engine == "vllm":
            raise PlanError("--draft HEAD with --engine vllm: a kvlab draft head runs in kvlab's engine; "
                            "use --engine kvlab")
        head.check_target(spec.hidden_size, spec.vocab_size, spec.name)
        head.check_k(request.num_speculative_tokens)
    elif request.draft is not None:
        if request.engine == "vllm":
            raise PlanError("--draft with --engine vllm: vLLM's draft-model allocator is not modelled; "
                            "use --engine kvlab")
        spec = with_draft(target, request.draft)  # both caches per token: the KV figures below count both
    per_token = capacity.kv_bytes_per_token(spec, formats, tp)
    per_sequence = capacity.kv_bytes_per_sequence(spec, request.context, formats, tp)
    weights = weight_bytes(target, request.weight_dtype, request.weight_group_size)
    if head is not None and weights is not None:
        weights += head_weight_bytes(head.params, target, weights)
    elif request.draft is not None and weights is not None:
        draft_weights = weight_bytes(request.draft, request.weight_dtype, request.weight_group_size)
        weights = None if draft_weights is None else weights + draft_weights
    weights_per_rank = None if weights is None else -(-weights // tp)
    result: dict[str, Any] = {
        "model": describe_model(spec),
        "inputs": {
            "context": request.context, "batch": request.batch, "kv_cache_dtype": formats.label,
            "k_dtype": formats.k.name, "v_dtype": formats.v.name, "model_dtype": request.model_dtype,
            "weight_dtype": request.weight_dtype, "tensor_parallel_size": tp, "engine": request.engine,
        },
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_sequence": per_sequence,
        "kv_bytes_batch": per_sequence * request.batch,
        "weight_bytes": weights,
        "weight_bytes_per_rank": weights_per_rank,
        "kv_heads_per_rank": None if spec.has_mla else capacity.kv_heads_per_rank(spec.kv_heads, tp),
        "warnings": request.warnings,
    }
    if spec.has_state:
        result["state_bytes_per_sequence"] = sum(capacity.state_bytes(layer, formats, tp) for layer in spec.layers)
    if formats.k.group_size or formats.v.group_size:
        result["inputs"]["kv_group_size"] = formats.k.group_size or formats.v.group_size
    if formats.k.residual or formats.v.residual:
        result["inputs"]["kivi_residual"] = formats.k.residual or formats.v.residual

    fixed = capacity.kv_fixed_bytes(spec, formats, tp)
    if fixed:  # KVQuant's codebooks and key channel statistics: once per model, out of the pool
        result["kv_fixed_bytes"] = fixed
    budget = _cache_budget(spec, request, weights_per_rank, result)
    if budget is None:
        if request.draft is not None:  # said, not dropped: the draft's share and speed-up are planned in a budget
            warning = ("--draft is planned within a memory budget: add --kv-cache-memory SIZE or --gpu CARD to see "
                       "the draft's share and speed-up")
            if warning not in request.warnings:
                request.warnings.append(warning)  # result["warnings"] is this list
        return result
    result["cache_budget_bytes"] = budget
    usable = max(budget - fixed, 0)
    if request.engine == "vllm":
        _add_vllm(spec, request, formats, usable, result)
    else:
        result["kv_cache_tokens"] = capacity.kv_cache_tokens(spec, usable, formats, tp)
        result["seats"] = capacity.seats(spec, usable, request.context, formats, tp)
        result["max_context"] = capacity.max_context(spec, usable, request.batch, formats, tp)
        _add_kvlab_pool(spec, request, formats, budget, result)
    result["fits"] = budget > 0 and result["seats"] >= request.batch
    if not result["fits"]:
        result["does_not_fit"] = _what_fits(request, budget, result)
    if request.device is not None and result["fits"]:  # no speed for what cannot run
        _add_speed(spec, request, formats, weights_per_rank, per_sequence, result)
    elif request.device is not None:
        result["binding_limit"] = MEMORY
    if head is not None:
        _add_head_speculation(target, head, request, formats, usable, result)
    elif request.draft is not None:
        _add_speculation(target, request, formats, usable, result)
    return result


def _add_vllm(spec: ModelSpec, request: PlanRequest, formats: capacity.CacheFormats, usable: int,
              result: dict[str, Any]) -> None:
    """vLLM's block arithmetic: `seats` and `max_context` are then vLLM's (whole blocks, windows as it reserves them)."""
    from kvlab.plan.vllm_blocks import vllm_capacity, vllm_longest_context
    tokens, _ = request.batch_defaults()
    args = (spec, usable, request.context, formats, request.block_size, request.tensor_parallel,
            request.vllm_device, tokens)
    vllm = vllm_capacity(*args, hybrid=request.vllm_hybrid, version=request.vllm_version)
    result["vllm"] = vllm
    result["seats"] = int(vllm["max_concurrency"])
    longest = vllm_longest_context(spec, usable, request.batch, formats, request.block_size, request.tensor_parallel,
                                   request.vllm_device, tokens, request.vllm_hybrid, request.vllm_version)
    if spec.max_context is not None and (longest is None or longest > spec.max_context):
        longest = spec.max_context  # vLLM refuses a --max-model-len beyond the model's positions
        result["max_context_limited_by"] = "max_position_embeddings"
    result["max_context"] = longest


def _add_kvlab_pool(spec: ModelSpec, request: PlanRequest, formats: capacity.CacheFormats, budget: int,
                    result: dict[str, Any]) -> None:
    """For the formats only kvlab serves (KIVI, KVQuant: state per seat), the lines kvlab's engine logs for a pool
    of `budget` bytes with --max-model-len = --context (kvlab.plan.pool_capacity; for the others, --engine vllm's)."""
    from kvlab.plan.pool_capacity import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS, engine_capacity, uses_seats
    if not uses_seats(formats) or request.tensor_parallel != 1:
        return
    try:
        result["kvlab_engine"] = engine_capacity(spec, budget, request.context, formats,
                                                 request.block_size or DEFAULT_BLOCK_SIZE,
                                                 request.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                                                 request.max_num_batched_tokens or 2048)
    except PlanError:  # a model the pool does not serve in this format (windows, MLA): the plan stands alone
        return


def _what_fits(request: PlanRequest, budget: int, result: dict[str, Any]) -> str:
    """The sentence a plan prints instead of speeds when the batch does not fit: what does."""
    if budget <= 0:
        return (f"the weights leave no cache budget ({budget / 2**30:.2f} GiB): use a larger card, more "
                "--tensor-parallel-size or a narrower --weight-dtype (kvlab plan MODEL --gpu A,B,C compares them)")
    longest = result["max_context"]
    context = "any context" if longest is None else f"{longest:,} tokens"
    return (f"{request.batch} sequences of {request.context:,} tokens do not fit: at most {result['seats']:,} "
            f"at {request.context:,} tokens, or {context} each at batch {request.batch}")


def _add_speculation(target: ModelSpec, request: PlanRequest, formats: capacity.CacheFormats, budget: int,
                     result: dict[str, Any]) -> None:
    """The draft's share of memory, the shared pool kvlab's engine builds, and the paper's expected speed-up."""
    draft, k = request.draft, request.num_speculative_tokens
    blocks, target_block, draft_block = shared_pool_blocks(target, draft, budget, formats, request.block_size or 16,
                                                           request.tensor_parallel)
    target_weights = active_weight_bytes(target, weight_bytes(target, request.weight_dtype,
                                                              request.weight_group_size))
    draft_weights = active_weight_bytes(draft, weight_bytes(draft, request.weight_dtype, request.weight_group_size))
    info: dict[str, Any] = {
        "draft": draft.name, "draft_weight_bytes": draft_weights,
        "draft_kv_bytes_per_token": capacity.kv_bytes_per_token(draft, formats, request.tensor_parallel),
        "block_size": request.block_size or 16, "pool_blocks": blocks,
        "pool_bytes_per_block": target_block + draft_block, "num_speculative_tokens": k,
        # a batch-1 decode step reads every weight once: the draft's step costs its share of the bytes
        "cost_ratio": draft_weights / target_weights if target_weights else None,
        "cost_ratio_basis": "weight bytes read per decode step (memory-bound batch-1 decode)",
    }
    if request.acceptance_rate is not None:
        info["acceptance_rate"] = request.acceptance_rate
        info["expected_tokens_per_step"] = expected_tokens_per_step(request.acceptance_rate, k)
        if info["cost_ratio"] is not None:
            info["verify_cost"] = request.verify_cost
            info["expected_speedup"] = expected_speedup(request.acceptance_rate, k, info["cost_ratio"],
                                                        request.verify_cost)
    result["speculative"] = info


def head_weight_bytes(params: int, target: ModelSpec, target_weights: int) -> int:
    """A head's bytes at the target's precision (the target's bytes per parameter): the engine reads both
    the same way (SmolLM2 and its head both in Q8_0 on the C kernels)."""
    return -(-params * target_weights // target.params_total) if target.params_total else 0


def _add_head_speculation(target: ModelSpec, head: DraftHead, request: PlanRequest, formats: capacity.CacheFormats,
                          budget: int, result: dict[str, Any]) -> None:
    """A draft head's share: its weights, its hidden states per sequence (outside the pool), the target's
    pool unchanged, and the paper's speed-up with the head's passes priced by the bytes they read."""
    k = request.num_speculative_tokens
    block_size = request.block_size or 16
    target_block = capacity.kv_bytes_per_sequence(target, block_size, formats, request.tensor_parallel)
    target_weights = active_weight_bytes(target, weight_bytes(target, request.weight_dtype,
                                                              request.weight_group_size))
    head_weights = None if target_weights is None else head_weight_bytes(head.params, target, target_weights)
    pass_weights = None if target_weights is None else head_weight_bytes(head.params_per_pass(k), target,
                                                                          target_weights)
    rate, source = request.acceptance_rate, "--acceptance-rate"
    if rate is None and head.held_out_agreement is not None:
        rate, source = head.held_out_agreement, "the head's held-out greedy agreement (its config.json)"
    info: dict[str, Any] = {
        "draft": head.label, "draft_kind": head.kind, "draft_weight_bytes": head_weights,
        "draft_kv_bytes_per_token": 0, "draft_state_bytes_per_sequence": head.state_bytes_per_sequence(),
        "block_size": block_size, "pool_blocks": max(0, budget) // target_block if target_block else 0,
        "pool_bytes_per_block": target_block, "num_speculative_tokens": k, "draft_passes": head.passes(k),
        # a batch-1 decode step reads every weight once: a head pass costs its share of the bytes
        "cost_ratio": pass_weights / target_weights if target_weights else None,
        "cost_ratio_basis": "weight bytes one head pass reads over the target's (memory-bound batch-1 decode)",
    }
    if rate is not None:
        info["acceptance_rate"], info["acceptance_source"] = rate, source
        info["expected_tokens_per_step"] = expected_tokens_per_step(rate, k)
        if info["cost_ratio"] is not None:
            info["verify_cost"] = request.verify_cost
            info["expected_speedup"] = expected_speedup(rate, k, info["cost_ratio"], request.verify_cost,
                                                        head.passes(k))
    result["speculative"] = info


def _cache_budget(spec: ModelSpec, request: PlanRequest, weights_per_rank: Optional[int],
                  result: dict[str, Any]) -> Optional[int]:
    if request.kv_cache_memory is not None:
        result["inputs"]["kv_cache_memory"] = request.kv_cache_memory
        return request.kv_cache_memory
    card = request.device
    if card is None:
        return None
    if weights_per_rank is None:
        raise PlanError("this model has no parameter count, so its weights are unknown: give --params")
    result["hardware"] = {
        "name": card.name, "memory_bytes": card.memory_bytes, "bandwidth_gbs": card.bandwidth_gbs,
        "bf16_tflops": card.bf16_tflops, "fp8_tflops": card.fp8_tflops, "source": card.source,
        "gpu_memory_utilization": request.gpu_memory_utilization,
    }
    if request.engine == "vllm" and request.vllm_device == "cuda":
        from kvlab.plan.vllm_memory import startup_budget
        tokens, seqs = request.batch_defaults()
        table = startup_budget(spec, card, weights_per_rank, release(request.vllm_version),
                               request.gpu_memory_utilization, tokens, seqs, request.tensor_parallel,
                               model_dtype_bytes(request.model_dtype))
        result["vllm_startup"] = table
        budget = table["available_bytes"]
    else:
        budget = int(card.memory_bytes * request.gpu_memory_utilization) - weights_per_rank
    if budget <= 0:
        request.warnings.append(f"the weights ({weights_per_rank:,} B per rank) leave no KV cache in "
                                f"{request.gpu_memory_utilization:.0%} of {card.name}'s memory")
    return budget


def _add_speed(spec: ModelSpec, request: PlanRequest, formats: capacity.CacheFormats, weights_per_rank: int,
               per_sequence: int, result: dict[str, Any]) -> None:
    card = request.device
    tp = request.tensor_parallel
    tflops = card.bf16_tflops
    if request.weight_dtype == "fp8" and card.fp8_tflops:
        tflops = card.fp8_tflops
    read = active_weight_bytes(spec, weights_per_rank)
    step = decode_step(spec, read, per_sequence, request.batch, request.context, card.bandwidth_gbs, tflops, tp)
    prompt = request.prompt_len or request.context
    result["decode_ms_per_token"] = step.seconds * 1e3
    result["decode_tokens_per_s"] = request.batch / step.seconds
    result["decode_bound"] = step.bound
    result["prefill_tokens"] = prompt
    result["prefill_ms"] = prefill_seconds(spec, prompt, tflops, tp) * 1e3
    result["tflops_used"] = tflops
    result["binding_limit"] = step.bound
