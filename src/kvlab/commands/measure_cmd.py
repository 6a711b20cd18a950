"""`kvlab measure`: run a real model and set what it did beside what the planner predicts.

The batch runs through the engine, as `kvlab serve` and `LLM` run it (the same path and speed
for the same flags), on a pool sized for exactly this batch (kvlab.engine.sizing). Planned
cache bytes come from kvlab.plan for the very config that ran (ModelConfig.to_plan_spec) and
that pool's blocks, and must equal the pool's `nbytes()` exactly. Speed is reported the way vLLM's benchmarks
define it: prefill tokens/s over the prompt, decode tokens/s over the one-token steps (the
inverse of TPOT), and the decode rate as a fraction of this machine's bandwidth roofline,
(weight bytes read per step + KV bytes read) / bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from kvlab.commands.args import non_negative_int, positive_float, positive_int
from kvlab.commands.lab_args import add_lab_arguments, load_from_args
from kvlab.plan.errors import PlanError

EXAMPLES = """examples:
  kvlab measure smollm2-135m
  kvlab measure smollm2-135m --kv-heads 1 --kv-cache-dtype int4 --batch 4 --json
  kvlab measure stories260k --prompt-len 256 --new-tokens 128 --bandwidth-gbs 40
"""


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_lab_arguments(parser)
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per sequence (128)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per sequence (64)")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together (1)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed for the random prompt tokens")
    parser.add_argument("--bandwidth-gbs", type=positive_float,
                        help="memory bandwidth for the roofline (default: measured once, kept in ~/.cache/kvlab)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def weight_bytes_read(model) -> int:
    """Bytes a batch-1 decode step streams: every parameter and saved buffer but the RoPE tables
    and the embedding table, of which a step reads one row (a tied LM head still counts, via
    lm_head). Unsaved buffers are derived copies a batch-1 step does not read (GGMLLinear's
    interleaved weights, for several rows at once)."""
    skip = {id(model.rope.cos), id(model.rope.sin)}
    modules = [module for name, module in model.named_modules() if name != "embed"]
    tensors = {id(t): t for module in modules
               for t in list(module.parameters(recurse=False)) +
               [b for name, b in module.named_buffers(recurse=False) if name not in module._non_persistent_buffers_set]}
    return sum(t.nbytes for key, t in tensors.items() if key not in skip)


def run_batch(model, tokenizer, prompts, new_tokens: int, kv_cache_dtype: str,
              kv_calibration: Optional[str] = None):
    """Decode `prompts` (a list of id lists) together through the engine, as `kvlab serve` would, on a
    pool sized for exactly this batch: (engine, sequences, prefill seconds, decode seconds)."""
    import torch

    from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
    from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
    from kvlab.engine.sizing import budget_for

    total = len(prompts[0]) + new_tokens
    chunk = max(2048, sum(len(p) for p in prompts))  # every prompt in one step, then the decode steps
    budget = budget_for(model, kv_cache_dtype, len(prompts), total, DEFAULT_BLOCK_SIZE, chunk)
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=budget,
                                                      max_num_seqs=len(prompts), max_num_batched_tokens=chunk,
                                                      enable_prefix_caching=False, max_model_len=total,
                                                      kv_calibration=kv_calibration))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    with torch.inference_mode():
        engine.add_request(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        engine.run_until_done()  # warm-up: kernels built, scratch grown, pages touched
        start = engine.clock()
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run_until_done()
    first = max(seq.first_token_time for seq in seqs)
    return engine, seqs, first - start, max(seq.last_token_time for seq in seqs) - first


def measure(args: argparse.Namespace) -> dict:
    import torch

    from kvlab.bench.provenance import provenance
    from kvlab.cache.base import model_dtype_name
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
    from kvlab.plan.pool_capacity import engine_capacity
    from kvlab.plan.roofline import decode_step

    loaded = load_from_args(args)
    model, config = loaded.model, loaded.model.config
    total = args.prompt_len + args.new_tokens
    if total > config.max_seq_len:
        raise PlanError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds the model's "
                        f"{config.max_seq_len}-token context")
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(args.seed))
    held = total - 1  # the last token generated is never fed back, so the cache ends holding this many
    from kvlab.engine.llm import kv_calibration_for
    calibration = kv_calibration_for(args.model, args.kv_cache_dtype, args.kv_calibration)
    engine, seqs, prefill_s, decode_s = run_batch(model, loaded.tokenizer, prompt.tolist(), args.new_tokens,
                                                  args.kv_cache_dtype, calibration)
    stats = {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": args.new_tokens - 1}

    spec = config.to_plan_spec()
    model_dtype = model_dtype_name(model.dtype)
    formats = cache_formats(args.kv_cache_dtype, model_dtype=model_dtype)
    pool = engine.pool
    capacity = engine_capacity(spec, pool.nbytes(), engine.max_model_len, formats, pool.block_size, pool.seats)
    planned = capacity["num_gpu_blocks"] * capacity["block_bytes_all_layers"] + capacity.get("residual_bytes", 0) + \
        capacity.get("fixed_bytes", 0)
    measured = pool.nbytes()  # the pool sized for this batch (kvlab.engine.sizing): the plan's bytes for its blocks

    if args.bandwidth_gbs:
        bandwidth, source = args.bandwidth_gbs, "--bandwidth-gbs"
    else:
        from kvlab.bench.bandwidth import machine_bandwidth_gbs
        bandwidth, source = machine_bandwidth_gbs()
    weights = weight_bytes_read(model)
    mean_context = args.prompt_len + args.new_tokens // 2
    kv_read = kv_bytes_per_sequence(spec, mean_context, formats)
    floor = decode_step(spec, weights, kv_read, args.batch, mean_context, bandwidth, float("inf")).seconds
    steps = stats["decode_steps"]
    decode_rate = args.batch * steps / stats["decode_s"] if steps else None
    roofline_rate = args.batch / floor
    return {
        "model": config.name, "path": loaded.path,
        "config": {"layers": config.n_layers, "q_heads": config.n_heads, "kv_heads": config.kv_heads,
                   "head_dim": config.head_size, "params": config.param_count()},
        "weights": model.packing, "dtype": model_dtype,
        "decode_path": engine.decode_path,
        "kv_cache_dtype": args.kv_cache_dtype, "kv_format": formats.label,
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "tokens_cached": held,
        "kv_bytes_planned": planned, "kv_bytes_measured": measured, "kv_bytes_match": planned == measured,
        "kv_pool_blocks": pool.num_blocks, "kv_block_size": pool.block_size,
        "kv_bytes_per_sequence_planned": kv_bytes_per_sequence(spec, held, formats),
        "prefill_tokens_per_s": args.batch * args.prompt_len / stats["prefill_s"],
        "decode_tokens_per_s": decode_rate,
        "weight_bytes_read_per_step": weights, "kv_bytes_read_per_sequence": kv_read,
        "bandwidth_gbs": round(bandwidth, 2), "bandwidth_source": source,
        "roofline_decode_tokens_per_s": roofline_rate,
        "roofline_fraction": decode_rate / roofline_rate if decode_rate else None,
        "provenance": provenance(),
    }


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=120)
    table = Table(title=f"{result['model']}: {result['batch']} x ({result['prompt_len']} prompt + "
                        f"{result['new_tokens']} new tokens), {result['weights']} weights ({result['decode_path']}), "
                        f"{result['dtype']} activations, "
                        f"{result['provenance']['machine']['torch_threads']} threads")
    table.add_column("quantity")
    table.add_column("planned / roofline", justify="right")
    table.add_column("measured", justify="right")
    match = "[green]equal[/green]" if result["kv_bytes_match"] else "[red]differ[/red]"
    table.add_row(f"KV cache bytes ({result['kv_format']}) {match}", f"{result['kv_bytes_planned']:,}",
                  f"{result['kv_bytes_measured']:,}")
    table.add_row("prefill tokens/s", "", f"{result['prefill_tokens_per_s']:,.0f}")
    decode = result["decode_tokens_per_s"]
    table.add_row("decode tokens/s", f"{result['roofline_decode_tokens_per_s']:,.1f}",
                  f"{decode:,.1f}" if decode else "n/a")
    if result["roofline_fraction"] is not None:
        table.add_row("fraction of bandwidth roofline", "", f"{result['roofline_fraction']:.0%}")
    table.add_row("weight bytes read per step", "", f"{result['weight_bytes_read_per_step']:,}")
    table.add_row("bandwidth GB/s", "", f"{result['bandwidth_gbs']} ({result['bandwidth_source']})")
    console.print(table)
    return 0
