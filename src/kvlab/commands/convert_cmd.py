"""`kvlab convert SRC -o OUT`: a real checkpoint with its KV heads changed, as files others load.

MHA -> GQA -> MQA by mean-pooling each group of K/V heads (the GQA paper's uptraining start),
by keeping the group's first head, or by random init; more heads than the source by
repetition, which is exact. OUT is a Hugging Face directory transformers loads offline; with
--gguf it also holds model.gguf for llama.cpp. The KV bytes per token before and after come
from kvlab.plan for the exact shapes written.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvlab.commands.args import non_negative_int, positive_int

EXAMPLES = """examples:
  kvlab convert smollm2-135m --kv-heads 1 -o smollm2-mqa              # GQA (3 KV heads) -> MQA
  kvlab convert smollm2-135m --kv-heads 9 -o smollm2-mha --gguf       # -> MHA, exact; also model.gguf
  kvlab convert stories260k --kv-heads 2 --method first -o s260k-kv2
  kvlab convert ./my-hf-dir --kv-heads 4 -o out --force --json
"""
METHODS = ("mean", "first", "random")


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="SRC",
                        help="smollm2-135m, stories260k, a .gguf file, a Hugging Face directory or a kvlab .pt")
    parser.add_argument("-o", "--out", required=True, metavar="OUT", help="the directory to write (must not exist)")
    parser.add_argument("--kv-heads", type=positive_int,
                        help="KV heads of the result; must divide the query heads (default: unchanged)")
    parser.add_argument("--method", choices=METHODS, default="mean",
                        help="fewer heads from each group's mean (default), first head, or a random init")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of --method random (0)")
    parser.add_argument("--gguf", action="store_true", help="also write OUT/model.gguf (F32) for llama.cpp")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists (atomically, at the end)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlab.checkpoints.export import check_out, convert_model, load_source, write_outputs
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_token
    from kvlab.train.progress import progress_bar

    check_out(args.out, args.force)
    bar = progress_bar(4 if args.gguf else 3, "convert: load", enabled=not args.json, unit="stage")

    def step(label: str) -> None:
        if bar is not None:
            bar.set_description(f"convert: {label}")
            bar.update(1)

    try:
        source = load_source(args.source)
        step("heads")
        model = convert_model(source.model, args.kv_heads, args.method, args.seed)
        files = write_outputs(model, source, args.out, args.gguf, args.force, step)
        step("done")
    finally:
        if bar is not None:
            bar.close()
    fp16 = cache_formats("fp16")
    before, after = source.model.config, model.config
    report = {
        "source": source.path, "out": args.out, "files": files, "method": args.method if args.kv_heads else None,
        "heads": after.n_heads, "kv_heads_before": before.kv_heads, "kv_heads_after": after.kv_heads,
        "kv_bytes_per_token_fp16_before": kv_bytes_per_token(before.to_plan_spec(), fp16),
        "kv_bytes_per_token_fp16_after": kv_bytes_per_token(after.to_plan_spec(), fp16),
        "params": after.param_count(),
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"{report['source']} -> {args.out}: {after.n_heads} query heads, KV heads {before.kv_heads} -> "
          f"{after.kv_heads}" + (f" ({args.method})" if args.kv_heads else ""))
    print(f"KV cache per token (fp16): {report['kv_bytes_per_token_fp16_before']:,} B -> "
          f"{report['kv_bytes_per_token_fp16_after']:,} B; {report['params']:,} parameters")
    print(f"wrote {', '.join(files)}")
    return 0
