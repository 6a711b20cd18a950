"""`kvlab generate`: stream a real model's continuation of a prompt to the terminal."""

from __future__ import annotations

import argparse
import sys

from kvlab.checkpoints.tokenizer import prompt_ids
from kvlab.commands.args import non_negative_float, non_negative_int, positive_int, unit_interval
from kvlab.commands.lab_args import add_lab_arguments, load_from_args
from kvlab.plan.errors import PlanError

EXAMPLES = """examples:
  kvlab generate stories260k --prompt "Once upon a time" --max-tokens 40 --temperature 0
  kvlab generate smollm2-135m --chat --prompt "What is a KV cache?" --max-tokens 80
  kvlab generate smollm2-135m --prompt "Once upon a time" --temperature 0.8 --top-p 0.9 --seed 1
  kvlab generate smollm2-135m --prompt "The capital of France is" --kv-heads 1 --kv-cache-dtype int8
"""


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_lab_arguments(parser)
    parser.add_argument("--prompt", default="", help="text to continue (empty: start from the BOS token)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens at most (default 64)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=positive_int, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=unit_interval, default=1.0,
                        help="sample among the likeliest tokens whose probability reaches P (nucleus; default 1 = off)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Decode through the engine, as `LLM` and `kvlab serve` do: the same flags give the same path,
    the same tokens and the same speed in all three."""
    import torch

    from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
    from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
    from kvlab.engine.llm import kv_calibration_for
    from kvlab.engine.sizing import budget_for

    loaded = load_from_args(args)
    model, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise PlanError(f"{loaded.path} has no tokenizer (tokenizer.json) to turn text into tokens")
    ids = prompt_ids(tokenizer, args.prompt, args.chat)
    total = len(ids) + args.max_tokens
    if total > model.config.max_seq_len:
        raise PlanError(f"prompt ({len(ids)} tokens) + --max-tokens {args.max_tokens} exceeds the model's "
                        f"{model.config.max_seq_len}-token context")
    chunk = 2048
    budget = budget_for(model, args.kv_cache_dtype, 1, total, DEFAULT_BLOCK_SIZE, chunk)
    calibration = kv_calibration_for(args.model, args.kv_cache_dtype, args.kv_calibration)
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=budget,
                                                      max_num_seqs=1, max_num_batched_tokens=chunk, seed=args.seed,
                                                      max_model_len=total, kv_calibration=calibration))

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if not args.chat:
        write(tokenizer.decode(ids))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k or 0,
                            top_p=args.top_p, seed=args.seed)
    seq = engine.add_request(ids, params)
    with torch.inference_mode():
        while engine.has_unfinished():
            for delta in engine.step():
                write(delta.text)
    write("\n")
    new = len(seq.output_ids)
    prefill = seq.first_token_time - seq.arrival
    rate = ""
    if new > 1 and seq.last_token_time > seq.first_token_time:
        rate = f", {(new - 1) / (seq.last_token_time - seq.first_token_time):.1f} tok/s decode"
    pool = engine.pool
    print(f"[kvlab] {len(ids)} prompt + {new} new tokens; prefill {prefill * 1e3:.0f} ms{rate}; "
          f"KV pool {pool.kv_format.name} {pool.nbytes():,} B ({pool.num_blocks} blocks of {pool.block_size} tokens, "
          f"{engine.decode_path})", file=sys.stderr)
    return 0
