"""`kvlab generate`: stream a real model's continuation of a prompt to the terminal."""

from __future__ import annotations

import argparse
import sys

from kvlab.commands.args import non_negative_int, positive_int
from kvlab.commands.lab_args import add_lab_arguments, load_from_args
from kvlab.plan.errors import PlanError

EXAMPLES = """examples:
  kvlab generate stories260k --prompt "Once upon a time" --max-tokens 40 --temperature 0
  kvlab generate smollm2-135m --chat --prompt "What is a KV cache?" --max-tokens 80
  kvlab generate smollm2-135m --prompt "Once upon a time" --temperature 0.8 --top-p 0.9 --seed 1
  kvlab generate smollm2-135m --prompt "The capital of France is" --kv-heads 1 --kv-cache-dtype int8
"""


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def unit_interval(text: str) -> float:
    """A probability in (0, 1], as --top-p takes it (vLLM's range for top_p)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


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


def prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        text = tokenizer.render_chat([{"role": "user", "content": text}])
        return tokenizer.encode(text, add_bos=False) if tokenizer.bos_id is None else tokenizer.encode(text)
    ids = tokenizer.encode(text) if text else []
    if not ids:
        if tokenizer.bos_id is None:
            raise PlanError("this model has no BOS token; give a --prompt")
        ids = [tokenizer.bos_id]
    return ids


def run(args: argparse.Namespace) -> int:
    import torch

    from kvlab.cache.pool import KVPool
    from kvlab.checkpoints.tokenizer import TextStream
    from kvlab.nn.generate import cache_for_generation, generate

    loaded = load_from_args(args)
    model, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise PlanError(f"{loaded.path} has no tokenizer (tokenizer.json) to turn text into tokens")
    ids = prompt_ids(tokenizer, args.prompt, args.chat)
    total = len(ids) + args.max_tokens
    if total > model.config.max_seq_len:
        raise PlanError(f"prompt ({len(ids)} tokens) + --max-tokens {args.max_tokens} exceeds the model's "
                        f"{model.config.max_seq_len}-token context")
    cache = cache_for_generation(model, 1, total, args.kv_cache_dtype)

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if not args.chat:
        write(tokenizer.decode(ids))
    stream = TextStream(tokenizer, write, context=ids[-1:])
    stats: dict = {}
    out = generate(model, ids, args.max_tokens, args.temperature, args.top_k,
                   torch.Generator().manual_seed(args.seed), cache,
                   stop_ids=[tokenizer.eos_id] if tokenizer.eos_id is not None else [],
                   on_token=lambda next_ids: stream.push(int(next_ids[0])), stats=stats, top_p=args.top_p)
    stream.flush()
    write("\n")
    steps = stats["decode_steps"]
    rate = f", {steps / stats['decode_s']:.1f} tok/s decode" if steps and stats["decode_s"] > 0 else ""
    held = (f"KV pool {args.kv_cache_dtype} {cache.nbytes():,} B ({cache.num_blocks} blocks of {cache.block_size} tokens)"
            if isinstance(cache, KVPool) else f"KV cache {args.kv_cache_dtype} {cache.nbytes():,} B")
    print(f"[kvlab] {len(ids)} prompt + {out.shape[1]} new tokens; prefill {stats['prefill_s'] * 1e3:.0f} ms{rate}; "
          f"{held}", file=sys.stderr)
    return 0
