"""`kvlab convert SRC -o OUT`: a real checkpoint with its KV heads changed, as files others load.

MHA -> GQA -> MQA by mean-pooling each group of K/V heads (the GQA paper's uptraining start),
by keeping the group's first head, or by random init; more heads than the source by
repetition, which is exact. OUT is a Hugging Face directory transformers loads offline; with
--gguf it also holds model.gguf for llama.cpp. --to mla instead writes latent attention
(DeepSeek-V2's config format with two kvlab extensions; see MLA_NOTE). The KV bytes per token
before and after come from kvlab.plan for the exact shapes written.
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
  kvlab convert gemma-3-270m --kv-heads 4 -o gemma-mha --gguf        # Gemma 3: 1 -> 4 KV heads, exact
  kvlab convert ./my-hf-dir --kv-heads 4 -o out --force --json
  kvlab convert stories260k --to mla --kv-lora-rank full -o s260k-mla  # exact: reproduces the source
  kvlab convert smollm2-135m --to mla --kv-lora-rank 128 --rope-dim 32 -o smollm2-mla

--to mla: per KV head, the --rope-dim channels of the highest-frequency RoPE pairs keep their
rotation and are cached as that head's decoupled RoPE key; the other key channels lose RoPE and,
with the values, are factorised jointly by SVD into a latent of --kv-lora-rank channels. Cached
per token per layer: rank + KV heads x rope-dim. Exact at full rank with --rope-dim = head dim.
OUT's config.json is DeepSeek-V2's format plus kvlab_rope_key_heads (one RoPE key per source KV
head) and kvlab_latent_norm: false. kvlab (and its planner) loads it; transformers' DeepseekV2
cannot load it exactly: it always RMS-normalises the latent and shares one RoPE key, so with
more than one KV head its shapes do not match, and with one it computes a different function.
"""
METHODS = ("mean", "first", "random")


def rank_or_full(text: str):
    """--kv-lora-rank: an integer (checked against the full rank once the model is known) or 'full'."""
    if text == "full":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'full', got {text!r}") from None


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="SRC",
                        help="smollm2-135m, stories260k, gemma-3-270m, a .gguf file, a Hugging Face directory or a kvlab .pt")
    parser.add_argument("-o", "--out", required=True, metavar="OUT", help="the directory to write (must not exist)")
    parser.add_argument("--kv-heads", type=positive_int,
                        help="KV heads of the result; must divide the query heads (default: unchanged)")
    parser.add_argument("--method", choices=METHODS, default="mean",
                        help="fewer heads from each group's mean (default), first head, or a random init")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of --method random (0)")
    parser.add_argument("--to", choices=("mla",), help="convert attention to MLA latent attention (see below)")
    parser.add_argument("--kv-lora-rank", type=rank_or_full, metavar="R",
                        help="--to mla: latent channels, 1 to the full rank, or 'full' (exact with the default "
                             "--rope-dim)")
    parser.add_argument("--rope-dim", type=int, metavar="D",
                        help="--to mla: RoPE channels each KV head keeps, even, 2 to the head dim (default: the "
                             "head dim, every channel, exact)")
    parser.add_argument("--gguf", action="store_true", help="also write OUT/model.gguf (F32) for llama.cpp")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists (atomically, at the end)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlab.checkpoints.export import check_out, convert_model, load_source, write_outputs
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_token
    from kvlab.train.progress import progress_bar

    mla = _check_mla_flags(args)
    check_out(args.out, args.force)
    bar = progress_bar(4 if args.gguf else 3, "convert: load", enabled=not args.json, unit="stage")

    def step(label: str) -> None:
        if bar is not None:
            bar.set_description(f"convert: {label}")
            bar.update(1)

    try:
        source = load_source(args.source)
        step("mla" if mla else "heads")
        conversion = None
        if mla:
            conversion = _to_mla(source.model, args.kv_lora_rank, args.rope_dim)
            model = conversion.model
        else:
            model = convert_model(source.model, args.kv_heads, args.method, args.seed)
        files = write_outputs(model, source, args.out, args.gguf, args.force, step)
        step("done")
    finally:
        if bar is not None:
            bar.close()
    fp16 = cache_formats("fp16")
    before, after = source.model.config, model.config
    pooled = bool(args.kv_heads) and after.kv_heads != before.kv_heads  # asked for the heads it has: a copy
    report = {
        "source": source.path, "out": args.out, "files": files, "method": args.method if pooled else None,
        "heads": after.n_heads, "kv_heads_before": before.kv_heads,
        "kv_heads_after": after.kv_heads if after.attention == "gqa" else None,
        "kv_bytes_per_token_fp16_before": kv_bytes_per_token(before.to_plan_spec(), fp16),
        "kv_bytes_per_token_fp16_after": kv_bytes_per_token(after.to_plan_spec(), fp16),
        "params": after.param_count(),
    }
    if conversion is not None:
        report.update(to="mla", kv_lora_rank=after.kv_lora_rank, full_rank=conversion.full_rank,
                      rope_dim=after.qk_rope_head_dim, rope_key_heads=after.rope_key_heads,
                      kept_energy_per_layer=list(conversion.kept_energy),
                      kept_energy_min=min(conversion.kept_energy), exact=conversion.exact,
                      head_dim=before.head_size)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    if conversion is not None:
        print(f"{report['source']} -> {args.out}: MLA, latent rank {after.kv_lora_rank} of {conversion.full_rank}, "
              f"{after.rope_key_heads} RoPE keys x {after.qk_rope_head_dim} of head dim {before.head_size}; "
              f"SVD energy kept {min(conversion.kept_energy):.4f} (worst layer)"
              + ("; exact" if conversion.exact else "; approximate"))
    else:
        print(f"{report['source']} -> {args.out}: {after.n_heads} query heads, KV heads {before.kv_heads} -> "
              f"{after.kv_heads}" + (f" ({args.method})" if pooled else " (unchanged)"))
    print(f"KV cache per token (fp16): {report['kv_bytes_per_token_fp16_before']:,} B -> "
          f"{report['kv_bytes_per_token_fp16_after']:,} B; {report['params']:,} parameters")
    print(f"wrote {', '.join(files)}")
    return 0


def _check_mla_flags(args: argparse.Namespace) -> bool:
    """Whether --to mla was asked, refusing flag mixes before any work."""
    from kvlab.plan.errors import PlanError

    if args.to != "mla":
        if args.kv_lora_rank is not None or args.rope_dim is not None:
            raise PlanError("--kv-lora-rank and --rope-dim need --to mla")
        return False
    if args.kv_heads is not None:
        raise PlanError("--to mla and --kv-heads are separate conversions; run them one after the other")
    if args.kv_lora_rank is None:
        raise PlanError("--to mla needs --kv-lora-rank R (or 'full')")
    if args.gguf:
        raise PlanError("--gguf writes Llama-family and Gemma 3 GGUF files; llama.cpp has no kvlab MLA layout")
    return True


def _to_mla(model, rank, rope_dim):
    from kvlab.checkpoints.mla import convert_to_mla, full_rank

    rope_dim = model.config.head_size if rope_dim is None else rope_dim
    if rank == "full":
        rank = full_rank(model.config, rope_dim)
    return convert_to_mla(model, rank, rope_dim)
