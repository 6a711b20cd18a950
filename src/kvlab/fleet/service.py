"""One replica, from the planner: cards for the weights, KV blocks, scheduler limits, step cost.

A replica is `tensor_parallel` cards running one engine. Its KV pool is what the planner says
is left on a rank after the weights at `gpu_memory_utilization` (kvlab.plan.planner.plan),
cut into `block_size`-token blocks of kvlab.plan's bytes per token, so the simulated pool
holds exactly the bytes the plan allows. Without `--tensor-parallel-size` the replica takes
the fewest cards (1, 2, 4, 8, ...) on which the weights fit and one longest request's KV fits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

from kvlab.fleet.errors import FleetError
from kvlab.fleet.speculation import ScaledCost, Speculation
from kvlab.fleet.step_cost import LinearCost, RooflineCost
from kvlab.plan.capacity import kv_bytes_per_token
from kvlab.plan.errors import PlanError
from kvlab.plan.hardware import Device
from kvlab.plan.planner import PlanRequest, plan
from kvlab.plan.spec import ModelSpec
from kvlab.plan.weights import active_weight_bytes, weight_bytes

TP_CHOICES = (1, 2, 4, 8, 16, 32, 64)
PLAN_BLOCK_SIZE = 16  # a replica planned for a card cuts its pool as vLLM does on GPUs (kvlab serve takes 64 on CPUs)


@dataclass
class ReplicaSpec:
    """Everything a simulated replica needs: the scheduler's limits, the pool, and the step price."""

    cards: int  # tensor-parallel degree
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    cost: Union[RooflineCost, LinearCost]
    enable_prefix_caching: bool = True
    kv_bytes_per_token: float = 0.0  # per rank
    weight_bytes_per_rank: int = 0
    kv_budget_bytes: int = 0  # per rank
    notes: list[str] = field(default_factory=list)
    speculation: Optional[Speculation] = None  # a draft model: its KV shares the blocks, its rounds the steps

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> dict:
        return {"cards": self.cards, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "kv_tokens": self.kv_tokens, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens, "max_model_len": self.max_model_len,
                "enable_prefix_caching": self.enable_prefix_caching, "kv_bytes_per_token_per_rank":
                self.kv_bytes_per_token, "weight_bytes_per_rank": self.weight_bytes_per_rank,
                "kv_budget_bytes_per_rank": self.kv_budget_bytes, "cost": self.cost.describe(), "notes": self.notes,
                "speculative": self.speculation.describe() if self.speculation else None}


def attention_flops_per_pair(spec: ModelSpec, tensor_parallel: int) -> float:
    return sum(2 * layer.q_heads * (layer.k_head_dim + layer.v_head_dim)
               for layer in spec.layers if not layer.is_state) / tensor_parallel


def _plan_for(spec: ModelSpec, request: PlanRequest, tp: int) -> dict:
    request.tensor_parallel = tp
    request.warnings = []
    return plan(spec, request)


def weights_fit_tp(spec: ModelSpec, request: PlanRequest, max_model_len: int, block_size: int) -> int:
    """The fewest cards (a power of two the KV heads allow) holding the weights and one longest request."""
    for tp in TP_CHOICES:
        try:
            result = _plan_for(spec, request, tp)
        except PlanError:
            continue  # the heads cannot be split over tp ranks
        budget = result.get("cache_budget_bytes", 0)
        per_token = result["kv_bytes_per_token"]
        if budget > 0 and budget // per_token // block_size * block_size >= max_model_len:
            return tp
    raise FleetError(f"{spec.name} does not fit on up to {TP_CHOICES[-1]} cards of this kind")


def replica_from_plan(spec: ModelSpec, request: PlanRequest, *, max_model_len: int,
                      block_size: int = PLAN_BLOCK_SIZE,
                      max_num_seqs: int = 256, max_num_batched_tokens: Optional[int] = None,
                      tensor_parallel: Optional[int] = None, calibration: Optional[LinearCost] = None,
                      bandwidth_efficiency: Optional[float] = None, compute_efficiency: Optional[float] = None,
                      step_overhead_s: Optional[float] = None, enable_prefix_caching: bool = True,
                      seed: int = 0) -> ReplicaSpec:
    """The replica `kvlab fleet` simulates for `spec` on `request.device` (or `request.kv_cache_memory`).

    With `request.draft` (and its acceptance rate and k), the plan counts the draft's weights and
    KV: the pool is the plan's `speculative.pool_blocks` of `block_size` tokens, each holding both
    caches, and the replica prices the draft's rounds with a roofline of its own (same card and
    efficiencies) or, under a calibration, the calibrated cost times the plan's cost ratio.
    """
    if request.draft is not None:
        request.block_size = block_size  # the plan's shared pool, cut into the simulator's blocks
    if request.device is None and request.kv_cache_memory is None:
        raise FleetError("give --gpu CARD (or --kv-cache-memory with --calibration)")
    tp = tensor_parallel or (weights_fit_tp(spec, request, max_model_len, block_size) if request.device else 1)
    result = _plan_for(spec, request, tp)
    budget = int(result.get("cache_budget_bytes", 0))
    per_token = result["kv_bytes_per_token"]
    if budget <= 0:
        raise FleetError(f"the weights ({result['weight_bytes_per_rank']:,} B per card) leave no room for KV on "
                         f"{tp} card(s); raise --tensor-parallel-size")
    num_blocks = int(budget // per_token) // block_size
    if request.draft is not None:
        num_blocks = int(result["speculative"]["pool_blocks"])
    batched = max_num_batched_tokens or request.batched_tokens()
    notes = list(request.warnings)
    if num_blocks * block_size < max_model_len:
        notes.append(f"the pool ({num_blocks * block_size:,} tokens) is smaller than max_model_len")
    if calibration is not None:
        cost: Union[RooflineCost, LinearCost] = calibration
    else:
        card: Device = request.device
        if card is None:
            raise FleetError("the roofline needs --gpu CARD; or give --calibration FILE")
        tflops = card.fp8_tflops if request.weight_dtype == "fp8" and card.fp8_tflops else card.bf16_tflops
        kwargs = {k: v for k, v in (("bandwidth_efficiency", bandwidth_efficiency),
                                    ("compute_efficiency", compute_efficiency),
                                    ("step_overhead_s", step_overhead_s)) if v is not None}

        def roofline(model: ModelSpec) -> RooflineCost:
            """One model's step on a rank: its own active weights, KV bytes and FLOPs, this card's peaks."""
            weights = -(-weight_bytes(model, request.weight_dtype, request.weight_group_size) // tp)
            return RooflineCost(float(active_weight_bytes(model, weights)),
                                float(kv_bytes_per_token(model, request.formats(), tp)),
                                2.0 * (model.active_params or 0) / tp, attention_flops_per_pair(model, tp),
                                card.bandwidth_gbs, tflops, **kwargs)

        cost = roofline(spec)
    speculation = None
    if request.draft is not None:
        info = result["speculative"]
        draft_cost = ScaledCost(cost, round_ratio(info)) if calibration is not None or "draft_passes" in info \
            else roofline(request.draft)
        speculation = Speculation(info["draft"], float(request.acceptance_rate),
                                  int(request.num_speculative_tokens), draft_cost, seed)
    return ReplicaSpec(tp, num_blocks, block_size, max_num_seqs, batched, max_model_len, cost,
                       enable_prefix_caching, float(per_token), int(result["weight_bytes_per_rank"]), budget, notes,
                       speculation)


def calibrated_speculation(spec: ModelSpec, draft, acceptance_rate: float, k: int, engine: dict,
                           cost: LinearCost, max_model_len: int, seed: int = 0) -> tuple[int, Speculation]:
    """(blocks, speculation) for a calibrated engine given a draft: the calibrated pool's bytes re-cut into
    blocks holding both caches, and the draft priced at the calibrated cost times the plan's cost ratio."""
    from kvlab.plan.capacity import kv_bytes_per_sequence
    block_size = int(engine["block_size"])
    kv_dtype = engine.get("kv_cache_dtype") or "auto"
    request = PlanRequest(context=max_model_len, kv_cache_dtype=kv_dtype, model_dtype=engine.get("dtype") or "fp32",
                          block_size=block_size, draft=draft, acceptance_rate=acceptance_rate,
                          num_speculative_tokens=k)
    budget = int(engine["num_blocks"]) * kv_bytes_per_sequence(spec, block_size, request.formats())
    request.kv_cache_memory = budget
    info = plan(spec, request)["speculative"]
    if info["cost_ratio"] is None:
        raise FleetError(f"{spec.name} has no parameter count: the draft's relative cost is unknown")
    return int(info["pool_blocks"]), Speculation(info["draft"], acceptance_rate, k,
                                                 ScaledCost(cost, round_ratio(info)), seed)


def round_ratio(info: dict) -> float:
    """What the simulator charges per draft round, relative to the target's step: the plan's cost ratio, or for a
    built-in head its passes spread over the k rounds (a Medusa set drafts k tokens in one pass: a step drafting
    fewer than k is charged its share, near enough at batch 1 where every sequence drafts k). A head is priced by
    the target's step scaled (by a calibration or the roofline), not a roofline of its own: it has no K/V."""
    ratio = float(info["cost_ratio"])
    return ratio * info["draft_passes"] / info["num_speculative_tokens"] if "draft_passes" in info else ratio


def replica_kv_bytes(spec: ModelSpec, replica: ReplicaSpec, formats) -> float:
    """Bytes the simulated pool occupies on one rank (tests: never more than the plan's budget)."""
    return replica.num_blocks * replica.block_size * kv_bytes_per_token(spec, formats, replica.cards)


def load_calibration(path: str) -> tuple[LinearCost, dict]:
    """A `kvlab fleet calibrate` file: the fitted step cost and the engine settings it was measured with."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return LinearCost.from_dict(data["fit"]), data
    except OSError as error:
        raise FleetError(f"cannot read --calibration {path}: {error.strerror or error}") from None
    except (ValueError, KeyError, TypeError):
        raise FleetError(f"--calibration {path} is not a `kvlab fleet calibrate` file (no \"fit\")") from None
