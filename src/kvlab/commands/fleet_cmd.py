"""`kvlab fleet MODEL --gpu CARD --rate R`: size a serving fleet by simulating the engine's scheduler.

`kvlab fleet calibrate MODEL` measures the real engine here and writes the step-cost file that
`--calibration FILE` reads.
"""

from __future__ import annotations

import argparse
import json

from kvlab.commands.args import add_model_flags, byte_size, comma_list, non_negative_int, positive_float, \
    positive_int
from kvlab.commands.plan_args import add_model_arguments, add_speculative_arguments
from kvlab.files import write_json
from kvlab.fleet.service import PLAN_BLOCK_SIZE
from kvlab.plan.kv_formats import KV_CACHE_DTYPES, MODEL_DTYPES
from kvlab.plan.weights import WEIGHT_DTYPES

EXAMPLES = """examples:
  kvlab fleet llama-3-70b --gpu h100 --rate 50 --prompt-len 4096 --output-len 512 --slo ttft:2000 tpot:50 \\
      --find-min-cards --price-per-card-hour 2.5 --price-per-mtok 0.9
  kvlab fleet llama-3-70b --gpu h100 --kv-cache-dtype fp8 --kv-heads 64 --rate 50 --replicas 8 --json
  kvlab fleet smollm2-135m --gpu orin --rate 2 --prefix-fraction 1 --prefix-len 1536 --prompt-len 32 --output-len 8
  kvlab fleet smollm2-135m --calibration cal.json --rate 2 --prompt-len uniform:128:0.5 --output-len 64
  kvlab fleet calibrate smollm2-135m --output cal.json
lengths: N (fixed), uniform:MEAN:R (vLLM's range ratio), lognormal:MEAN:SIGMA
speculative decoding (--draft MODEL --acceptance-rate A [--num-speculative-tokens K]), as `kvlab plan --draft`:
  each KV block holds the target's and the draft's K/V (fewer blocks), the draft's weights share the cards,
  a decode reserves 1 + K slots (the engine's lookahead); a step costs up to K draft decode rounds plus one
  target pass over each sequence's 1 + K tokens (priced as a prompt chunk) and emits min(G, K) + 1 tokens per
  sequence, G geometric with P(G >= j) = A^j, never past the request's output length. The draft is priced by
  the same roofline and efficiencies on its own weights and KV; with --calibration, by the calibrated step
  cost times the plan's cost ratio (draft / target weight bytes), the pool being the calibrated bytes re-cut.
"""


def slo_item(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    name = name.strip().lower()
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if name not in ("ttft", "tpot", "e2el") or not ms > 0:
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2el:MS, got {text!r}")
    return name, ms


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text + ". `kvlab fleet calibrate MODEL` "
                                   "measures the real engine for --calibration.", epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("calibrate_model", nargs="?", metavar="CALIBRATE_MODEL",
                        help="with `calibrate`: the model the real engine loads (smollm2-135m, a .gguf, ...)")
    load = parser.add_argument_group("workload")
    load.add_argument("--rate", type=positive_float, default=1.0, help="arrivals per second (default 1)")
    load.add_argument("--burstiness", type=positive_float, default=1.0,
                      help="gamma shape of the gaps: 1 Poisson, <1 burstier (default 1)")
    load.add_argument("--num-requests", type=positive_int, help="requests to simulate (default: --duration x rate)")
    load.add_argument("--duration", type=positive_float, default=600.0,
                      help="seconds of arrivals when --num-requests is not given (default 600)")
    load.add_argument("--prompt-len", default="1024", help="prompt tokens after any shared prefix (default 1024)")
    load.add_argument("--output-len", default="256", help="output tokens (default 256)")
    load.add_argument("--prefix-fraction", type=float, default=0.0,
                      help="share of requests starting with a shared prefix (default 0)")
    load.add_argument("--prefix-len", type=non_negative_int, default=0, help="shared prefix tokens (default 0)")
    load.add_argument("--num-prefixes", type=positive_int, default=1, help="distinct shared prefixes (default 1)")
    load.add_argument("--trace", help="JSONL of {arrival, prompt_len, output_len[, prefix_id, prefix_len]} instead")
    load.add_argument("--seed", type=int, default=0, help="seed of arrivals and lengths (default 0)")
    add_speculative_arguments(parser, "with --draft (required): the chance the target accepts each drafted "
                                      "token; a step emits min(G, k) + 1 tokens, G geometric, drawn per request "
                                      "and output position from --seed (Leviathan et al.)")
    card = parser.add_argument_group("cards and precision (kvlab plan's what-ifs)")
    card.add_argument("--gpu", help="catalog card: h100-sxm, h200, a100-80gb, l4, l40s, rtx-4090, jetson-agx-orin-64gb")
    card.add_argument("--memory-gib", type=positive_float, help="custom card: memory in GiB")
    card.add_argument("--bandwidth-gbs", type=positive_float, help="custom card: bandwidth in GB/s")
    card.add_argument("--tflops", type=positive_float, help="custom card: dense bf16 TFLOP/s")
    card.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9, help="(0.9, as vLLM)")
    card.add_argument("--tensor-parallel-size", type=positive_int,
                      help="cards per replica (default: the fewest that hold the weights and one longest request)")
    card.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV dtype (auto = --dtype)")
    card.add_argument("--dtype", default="fp16", choices=MODEL_DTYPES, help="model dtype (fp16)")
    card.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES, help="weights (auto = bf16/GGUF)")
    card.add_argument("--kv-cache-memory", type=byte_size, help="KV pool per card instead of the card's leftover")
    engine = parser.add_argument_group("engine (vLLM's names)")
    engine.add_argument("--max-num-seqs", type=positive_int,
                        help="seats per replica (default 256, as vLLM on GPUs; calibrate and --calibration: 64, "
                             "as kvlab serve, or the calibration's)")
    engine.add_argument("--max-num-batched-tokens", type=positive_int,
                        help="tokens per step (vllm serve's default for the card: 8192 on 70+ GiB cards, else 2048)")
    engine.add_argument("--block-size", type=positive_int,
                        help=f"tokens per KV block (default {PLAN_BLOCK_SIZE}, as vLLM on GPUs; calibrate: "
                             "kvlab serve's default)")
    engine.add_argument("--max-model-len", type=positive_int, help="default: the longest request, within the model's")
    engine.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    engine.add_argument("--calibration", help="a `kvlab fleet calibrate` file: measured step costs and the engine's "
                                              "pool and limits replace the roofline and the card")
    engine.add_argument("--bandwidth-efficiency", type=positive_float, help="roofline: achieved/peak bandwidth (0.7)")
    engine.add_argument("--compute-efficiency", type=positive_float, help="roofline: achieved/peak FLOP/s (0.5)")
    engine.add_argument("--step-overhead-ms", type=float, help="roofline: fixed cost per engine step (2 ms)")
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--replicas", type=positive_int, default=1, help="replicas (default 1)")
    fleet.add_argument("--router", default="least-loaded", choices=("round-robin", "least-loaded"))
    fleet.add_argument("--simulator", default="auto", choices=("auto", "engine", "fast"),
                       help="engine: kvlab.engine's Scheduler itself; fast: the same policy aggregated; auto: engine "
                            "up to 500,000 prompt + output tokens")
    fleet.add_argument("--slo", nargs="+", type=slo_item, metavar="NAME:MS", help="e.g. ttft:2000 tpot:50")
    fleet.add_argument("--find-min-cards", action="store_true", help="the fewest replicas whose p95s meet --slo")
    fleet.add_argument("--price-per-card-hour", type=positive_float, help="dedicated cards' price (USD/hour)")
    fleet.add_argument("--price-per-mtok", type=positive_float, help="a pay-per-token price per million output tokens")
    fleet.add_argument("--sweep-rates", type=comma_list, metavar="R1,R2,..",
                       help="also simulate these rates (figure: tails and cards against rate)")
    calib = parser.add_argument_group("calibrate (kvlab fleet calibrate MODEL)")
    calib.add_argument("--output", help="calibration file to write (default fleet-calibration.json)")
    add_model_flags(calib, dtype=False)  # --dtype is the card's (fp16); calibration computes in fp32
    calib.add_argument("--batches", type=comma_list, default=["1", "4", "16", "32"], help="decode batch sizes")
    calib.add_argument("--contexts", type=comma_list, default=["64", "256"], help="decode contexts (tokens)")
    calib.add_argument("--chunks", type=comma_list, default=["16", "64", "128", "256", "512", "1024"],
                       help="single-prompt prefill sizes")
    calib.add_argument("--decode-steps", type=positive_int, default=8, help="timed decode steps per point (8)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object on stdout")
    out.add_argument("--plot", metavar="DIR", help="write PNG figures into DIR")
    out.add_argument("--save-result", metavar="FILE", help="write the JSON result (with provenance) to FILE")
    parser.set_defaults(run=run)


def _ints(items, flag: str) -> list[int]:
    from kvlab.fleet.errors import FleetError
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise FleetError(f"{flag} takes positive integers, got {','.join(items)}") from None
    if any(v < 1 for v in values):
        raise FleetError(f"{flag} takes positive integers, got {','.join(items)}")
    return values


def run(args: argparse.Namespace) -> int:
    if args.model == "calibrate":
        return run_calibrate(args)
    if args.calibrate_model is not None:
        from kvlab.fleet.errors import FleetError
        raise FleetError(f"unexpected argument {args.calibrate_model!r} (only `kvlab fleet calibrate MODEL` takes two)")
    from kvlab.commands.fleet_scenario import scenario_from_args
    from kvlab.fleet.scenario import Scenario
    scenario: Scenario = scenario_from_args(args)
    result = scenario.run(progress=not args.json)
    if args.plot:
        result["figures"] = scenario.figures(result, args.plot)
    if args.save_result:
        from kvlab.bench.provenance import provenance
        write_json(args.save_result, {**result, "provenance": provenance()})
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from kvlab.fleet.render import render
        render(result)
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from kvlab.fleet.errors import FleetError
    if not args.calibrate_model:
        raise FleetError("kvlab fleet calibrate needs a MODEL, e.g. kvlab fleet calibrate smollm2-135m")
    from rich.console import Console

    from kvlab.bench.provenance import provenance
    from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
    from kvlab.engine.engine import EngineConfig, LLMEngine
    from kvlab.engine.llm import load_for_engine
    from kvlab.fleet.calibrate import fit, measure
    console = Console(stderr=True)
    batches, contexts, chunks = (_ints(args.batches, "--batches"), _ints(args.contexts, "--contexts"),
                                 _ints(args.chunks, "--chunks"))
    dtype = "fp32"
    model, tokenizer = load_for_engine(args.calibrate_model, args.weights, dtype, args.threads)
    config = EngineConfig(kv_cache_dtype="auto" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                          kv_cache_memory=args.kv_cache_memory, block_size=args.block_size or DEFAULT_BLOCK_SIZE,
                          max_num_seqs=args.max_num_seqs or 64,
                          max_num_batched_tokens=args.max_num_batched_tokens or 2048,
                          max_model_len=args.max_model_len, enable_prefix_caching=False)
    engine = LLMEngine(model, tokenizer, config)
    if max(chunks) > config.max_num_batched_tokens:
        raise FleetError(f"--chunks up to {max(chunks)} exceed --max-num-batched-tokens "
                         f"{config.max_num_batched_tokens}")
    from rich.progress import Progress
    points = len(chunks) + len(batches) * len(contexts)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("timing engine steps", total=points)
        samples = measure(engine, batches, contexts, chunks, args.decode_steps, args.seed,
                          progress=lambda label: bar.update(task, advance=1, description=label))
    cost, quality = fit(samples)
    import torch
    data = {
        "kind": "kvlab fleet calibration",
        "model": args.calibrate_model,
        "fit": cost.describe(),
        "fit_quality": quality,
        "engine": {"num_blocks": engine.blocks.num_blocks, "block_size": config.block_size,
                   "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                   "max_model_len": engine.max_model_len, "kv_cache_dtype": config.kv_cache_dtype,
                   "kv_cache_memory": args.kv_cache_memory, "weights": args.weights, "dtype": dtype,
                   "decode_path": engine.decode_path, "threads": torch.get_num_threads()},
        "grid": {"batches": batches, "contexts": contexts, "chunks": chunks, "decode_steps": args.decode_steps},
        "samples": samples,
        "provenance": provenance(),
    }
    path = args.output or "fleet-calibration.json"
    write_json(path, data)
    if args.json:
        print(json.dumps({k: data[k] for k in ("model", "fit", "fit_quality", "engine")}, indent=2))
    else:
        console = Console()
        console.print(f"[bold]calibration of {args.calibrate_model}[/] ({len(samples)} timed steps) -> {path}")
        f = cost
        console.print(f"  decode step: {f.decode_base * 1e3:.2f} ms + {f.decode_per_seq * 1e3:.3f} ms/seq + "
                      f"{f.decode_per_ctx * 1e6:.3f} us/context token   (median error "
                      f"{quality['decode_median_abs_error']:.1%})")
        console.print(f"  prefill step: {f.mixed_base * 1e3:.2f} ms + {f.mixed_per_token * 1e3:.3f} ms/token + "
                      f"{f.mixed_per_pair * 1e9:.2f} ns/attention pair   (median error "
                      f"{quality['prefill_median_abs_error']:.1%})")
    return 0
