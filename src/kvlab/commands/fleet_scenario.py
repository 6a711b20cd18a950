"""`kvlab fleet`'s flags to a fleet Scenario: the one place the fleet reads argparse (kvlab.fleet stays below the CLI)."""

from __future__ import annotations

import argparse
import math

from kvlab.commands.plan_args import device_from_args, draft_from_args, model_from_args
from kvlab.fleet.errors import FleetError
from kvlab.fleet.scenario import Scenario
from kvlab.fleet.service import PLAN_BLOCK_SIZE, ReplicaSpec, calibrated_speculation, load_calibration, \
    replica_from_plan
from kvlab.fleet.workload import LengthDist, Workload, draw
from kvlab.plan.errors import PlanError
from kvlab.plan.planner import PlanRequest


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    spec = model_from_args(args)
    draft, acceptance_rate, k = draft_from_args(args, need_rate=True)
    prompt, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    num = args.num_requests or max(1, math.ceil(args.duration * args.rate))
    workload = Workload(args.rate, num, prompt, output, args.burstiness, args.prefix_fraction, args.prefix_len,
                        args.num_prefixes, args.seed, args.trace)
    requests = draw(workload)
    longest = int((requests.prompt_len + requests.output_len).max())
    max_model_len = args.max_model_len or max(longest, min(spec.max_context or longest, 2048))
    calibration = None
    tp_options: list[ReplicaSpec] = []
    card = device_from_args(args)
    if args.calibration:
        cost, calibration = load_calibration(args.calibration)
        engine = calibration.get("engine", {})
        replica = ReplicaSpec(1, int(engine["num_blocks"]), int(engine["block_size"]),
                              args.max_num_seqs or int(engine["max_num_seqs"]),
                              args.max_num_batched_tokens or int(engine["max_num_batched_tokens"]),
                              args.max_model_len or int(engine["max_model_len"]), cost, args.prefix_caching,
                              notes=[f"calibrated on this machine: {args.calibration}"])
        if draft is not None:
            blocks, speculation = calibrated_speculation(spec, draft, acceptance_rate, k, engine, cost,
                                                         replica.max_model_len, args.seed)
            replica.num_blocks, replica.speculation = blocks, speculation
        if card is not None:
            raise FleetError("give --calibration or --gpu, not both (a calibration is of the machine it ran on)")
    else:
        if card is None and args.kv_cache_memory is None:
            raise FleetError("give --gpu CARD (or --calibration FILE from `kvlab fleet calibrate`)")
        request = PlanRequest(context=max_model_len, kv_cache_dtype=args.kv_cache_dtype, model_dtype=args.dtype,
                              weight_dtype=args.weight_dtype, kv_cache_memory=args.kv_cache_memory, device=card,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              max_num_batched_tokens=args.max_num_batched_tokens, draft=draft,
                              acceptance_rate=acceptance_rate, num_speculative_tokens=k)
        overhead = None if args.step_overhead_ms is None else args.step_overhead_ms / 1000
        def build(tp):
            return replica_from_plan(spec, request, max_model_len=max_model_len,
                                     block_size=args.block_size or PLAN_BLOCK_SIZE,
                                     max_num_seqs=args.max_num_seqs or 256,
                                     max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel=tp,
                                     bandwidth_efficiency=args.bandwidth_efficiency,
                                     compute_efficiency=args.compute_efficiency, step_overhead_s=overhead,
                                     enable_prefix_caching=args.prefix_caching, seed=args.seed)
        replica = build(args.tensor_parallel_size)
        if args.find_min_cards and args.tensor_parallel_size is None and card is not None:
            tp_options = [replica]
            while tp_options[-1].cards * 2 <= 8:
                try:
                    tp_options.append(build(tp_options[-1].cards * 2))
                except (FleetError, PlanError):
                    break
    try:
        rates = [float(r) for r in args.sweep_rates or []]
    except ValueError:
        raise FleetError(f"--sweep-rates takes numbers, got {','.join(args.sweep_rates)}") from None
    slo = dict(args.slo) if args.slo else None
    return Scenario(spec, workload, replica, args.replicas, args.router, args.simulator, slo, args.find_min_cards,
                    args.price_per_card_hour, args.price_per_mtok, rates, card.name if card else None, calibration,
                    tp_options)
