"""`kvlab convert SRC -o OUT`: a real checkpoint with its KV heads changed, as files others load.

Fewer KV heads are merged `aligned` by default: fitted on calibration text, keys rotated onto
each other per RoPE frequency, values summarised, output projections refitted layer by layer;
`mean`, `first` and `random` pool the weights alone. More heads are repeated, which is exact.
`--to mla` writes latent attention in DeepSeek-V2's layout (one shared RoPE key, fitted on
calibration text) or, with `--layout kvlab`, kvlab's exact layout (one RoPE key per source KV
head). OUT is a Hugging Face directory transformers loads offline; with --gguf it also holds
model.gguf for llama.cpp. The KV bytes per token before and after come from kvlab.plan for the
exact shapes written.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvlab.commands.args import non_negative_int, positive_int, unit_interval

EXAMPLES = """examples:
  kvlab convert smollm2-135m --kv-heads 1 -o smollm2-mqa              # GQA (3 KV heads) -> MQA, aligned
  kvlab convert smollm2-135m --kv-heads 1 --method mean -o smollm2-mean  # the GQA paper's mean-pooled start
  kvlab convert smollm2-135m --kv-heads 9 -o smollm2-mha --gguf       # -> MHA, exact; also model.gguf
  kvlab convert gemma-3-270m --kv-heads 4 -o gemma-mha --gguf        # Gemma 3: 1 -> 4 KV heads, exact
  kvlab convert smollm2-135m --to mla --kv-cache-fraction 0.5 -o smollm2-mla   # DeepSeek-V2 layout, half the cache
  kvlab convert stories260k --to mla --layout kvlab --kv-lora-rank full -o s260k-mla  # exact: reproduces the source
  kvlab convert ./my-hf-dir --kv-heads 4 --calibration notes.txt -o out --force --json

Calibration (--method aligned, --to mla --layout deepseek): the first --calibration-tokens tokens
(default 16384) of --calibration FILE, in windows of 512; default ../shared/data/english/
pride-and-prejudice.txt. Never calibrate on the text you will evaluate the result on.

--to mla --layout deepseek (default): at each RoPE frequency the KV heads' keys are mixed into one
shared RoPE key of --rope-dim channels (their top principal component; what it leaves, per head,
becomes a key without RoPE), and those keys and the values are factorised jointly into a latent of
--kv-lora-rank channels on the calibration activations. Cached per token per layer: rank +
rope-dim; --kv-cache-fraction F sets that to F of the source's cache. config.json and the tensor
names are DeepSeek-V2's, so transformers' DeepseekV2 and vLLM load it.
--to mla --layout kvlab: per KV head, the --rope-dim channels of the highest-frequency RoPE pairs
keep their rotation and are cached as that head's RoPE key; the other key channels and the values
are factorised by SVD of the weights. Cached per token per layer: rank + KV heads x rope-dim;
exact at full rank with --rope-dim = head dim. config.json adds kvlab_rope_key_heads and
kvlab_latent_norm: false, which only kvlab reads.

A merged or factorised model approximates its source: measure it (kvlab eval OUT) and recover
it (kvlab uptrain OUT --teacher SRC).
"""
METHODS = ("aligned", "mean", "first", "random")
LAYOUTS = ("deepseek", "kvlab")


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
    parser.add_argument("--method", choices=METHODS, default="aligned",
                        help="fewer heads: aligned on calibration text (default), each group's mean, its first "
                             "head, or a random init")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of --method random (0)")
    parser.add_argument("--to", choices=("mla",), help="convert attention to MLA latent attention (see below)")
    parser.add_argument("--layout", choices=LAYOUTS, default="deepseek",
                        help="--to mla: DeepSeek-V2's layout, fitted on calibration text (default), or kvlab's "
                             "exact one")
    parser.add_argument("--kv-lora-rank", type=rank_or_full, metavar="R",
                        help="--to mla: latent channels, or 'full'")
    parser.add_argument("--kv-cache-fraction", type=unit_interval, metavar="F",
                        help="--to mla: cache F of the source's bytes per token (sets the rank)")
    parser.add_argument("--rope-dim", type=int, metavar="D",
                        help="--to mla: RoPE channels (deepseek: of the one shared key, default the head dim, or "
                             "half when the latent would be narrower; kvlab: of each KV head, default the head dim)")
    parser.add_argument("--pad-latent", type=positive_int, metavar="R",
                        help="with --to mla --layout deepseek, or on an MLA directory alone: widen the latent to R "
                             "channels with zeros (the same function; vLLM's CPU MLA kernel runs only R = 512 "
                             "with a 64-channel RoPE key: add --pad-rope 64 for a narrower one)")
    parser.add_argument("--pad-rope", type=positive_int, metavar="D",
                        help="with --pad-latent: widen the shared RoPE key to D channels, a multiple of its width "
                             "(the same function: each frequency keeps its angle, the channels between are zero)")
    parser.add_argument("--calibration", metavar="FILE", help="UTF-8 text the fits run on (see below)")
    parser.add_argument("--calibration-tokens", type=positive_int, default=16384, metavar="N",
                        help="calibration tokens (16384)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                        help="weights written: auto (default) = as the source ships them (bf16, or fp32 for "
                             "fp32 sources such as stories260K)")
    parser.add_argument("--gguf", action="store_true", help="also write OUT/model.gguf (F32) for llama.cpp")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists (atomically, at the end)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlab.checkpoints.export import check_out, load_source, output_dtype, write_outputs
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_token
    from kvlab.train.progress import progress_bar

    mla = _check_flags(args)
    check_out(args.out, args.force)
    source = load_source(args.source)
    if args.pad_latent is not None and not mla:
        return _pad_only(args, source)
    dtype = output_dtype(args.dtype, source)
    plan = _plan(args, source.model.config) if mla else None
    if args.kv_heads is not None:
        from kvlab.checkpoints.convert import check_kv_heads
        check_kv_heads(source.model.config, args.kv_heads)
    calibrated = (mla and args.layout == "deepseek") or (
        not mla and args.kv_heads is not None and args.method == "aligned"
        and args.kv_heads < source.model.config.kv_heads)
    if (args.calibration is not None or args.calibration_tokens != 16384) and not calibrated:
        from kvlab.plan.errors import PlanError
        raise PlanError("--calibration and --calibration-tokens are read by --method aligned (to fewer heads) "
                        "and --to mla --layout deepseek only")
    if mla and args.layout == "deepseek" and dtype == _fp16():
        from kvlab.plan.errors import PlanError
        raise PlanError("--dtype fp16 cannot hold DeepSeek's folded latent norm (its weights underflow); use bf16 "
                        "or fp32")
    calibration = None
    if calibrated:
        from kvlab.checkpoints.calibration import load_calibration
        calibration = load_calibration(source.tokenizer, args.calibration, args.calibration_tokens,
                                       min(512, source.model.config.max_seq_len))
    layers = source.model.config.n_layers
    bar = progress_bar(layers + 2 if calibrated else 3, "convert", enabled=not args.json, unit="step")

    def step(label: str) -> None:
        if bar is not None:
            bar.set_description(f"convert: {label}")
            bar.update(1)

    try:
        conversion, facts = None, None
        if mla:
            conversion, model = _to_mla(source.model, args.layout, plan, calibration,
                                        lambda i: step(f"layer {i + 1}/{layers}"))
            if args.pad_latent is not None:
                from kvlab.checkpoints.mla_aware import pad_latent
                model = pad_latent(model, args.pad_latent, args.pad_rope)
        else:
            model, facts = _heads(source.model, args, calibration, lambda i: step(f"layer {i + 1}/{layers}"))
            if not calibrated:
                step("heads")
        files = write_outputs(model, source, args.out, args.gguf, args.force, step, dtype)
    finally:
        if bar is not None:
            bar.close()
    fp16 = cache_formats("fp16")
    before, after = source.model.config, model.config
    changed = bool(args.kv_heads) and after.kv_heads != before.kv_heads  # asked for the heads it has: a copy
    method = (args.method if after.kv_heads < before.kv_heads else "repeated") if changed else None
    report = {
        "source": source.path, "out": args.out, "files": files, "method": method,
        "heads": after.n_heads, "kv_heads_before": before.kv_heads,
        "kv_heads_after": after.kv_heads if after.attention == "gqa" else None,
        "kv_bytes_per_token_fp16_before": kv_bytes_per_token(before.to_plan_spec(), fp16),
        "kv_bytes_per_token_fp16_after": kv_bytes_per_token(after.to_plan_spec(), fp16),
        "params": after.param_count(), "dtype": {v: k for k, v in _dtypes().items()}[dtype],
        "calibration": calibration.describe() if calibration is not None else None,
    }
    if facts is not None:
        report.update(key_energy_kept_min=min(f["key_energy_kept"] for f in facts),
                      value_energy_kept_min=min(f["value_energy_kept"] for f in facts),
                      groups_per_layer=[f["groups"] for f in facts])
    if conversion is not None:
        report.update(_mla_report(conversion, args.layout, after, before))
    lossy = (method not in (None, "repeated")) or (conversion is not None and not report.get("exact"))
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    if conversion is not None:
        print(_mla_line(report, args.out, after, before))
    else:
        label = f" ({method})" if changed else " (unchanged)"
        print(f"{report['source']} -> {args.out}: {after.n_heads} query heads, KV heads {before.kv_heads} -> "
              f"{after.kv_heads}{label}")
    print(f"KV cache per token (fp16): {report['kv_bytes_per_token_fp16_before']:,} B -> "
          f"{report['kv_bytes_per_token_fp16_after']:,} B; {report['params']:,} parameters, written in "
          f"{report['dtype']}")
    if calibration is not None:
        print(f"calibrated on {calibration.tokens:,} tokens of {calibration.source}")
    if lossy:
        print(f"approximate: measure it (kvlab eval {args.out}) and recover it "
              f"(kvlab uptrain {args.out} --teacher {args.source})")
    print(f"wrote {', '.join(files)}")
    return 0


def _pad_only(args: argparse.Namespace, source) -> int:
    """`kvlab convert MLA_DIR --pad-latent R -o OUT`: an MLA directory (uptrained or not) widened for vLLM's
    CPU kernel."""
    from kvlab.checkpoints.export import output_dtype, write_outputs
    from kvlab.checkpoints.mla_aware import pad_latent
    from kvlab.plan.errors import PlanError

    if args.kv_heads is not None:
        raise PlanError("--pad-latent and --kv-heads are separate conversions")
    if source.model.config.attention != "mla":
        raise PlanError("--pad-latent widens an MLA latent: give an MLA directory, or convert with --to mla")
    before, rope_before = source.model.config.kv_lora_rank, source.model.config.qk_rope_head_dim
    model = pad_latent(source.model, args.pad_latent, args.pad_rope)
    files = write_outputs(model, source, args.out, False, args.force, dtype=output_dtype(args.dtype, source))
    report = {"source": source.path, "out": args.out, "files": files, "kv_lora_rank_before": before,
              "kv_lora_rank": args.pad_latent, "qk_rope_head_dim_before": rope_before,
              "qk_rope_head_dim": model.config.qk_rope_head_dim}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        rope = f", RoPE key {rope_before} -> {report['qk_rope_head_dim']}" if report["qk_rope_head_dim"] != rope_before else ""
        print(f"{source.path} -> {args.out}: latent {before} -> {args.pad_latent} channels{rope} "
              "(zeros; the same function)")
        print(f"wrote {', '.join(files)}")
    return 0


def _dtypes() -> dict:
    from kvlab.cache.base import TORCH_DTYPES
    return TORCH_DTYPES


def _fp16():
    return _dtypes()["fp16"]


def _check_flags(args: argparse.Namespace) -> bool:
    """Whether --to mla was asked, refusing flag mixes before any work."""
    from kvlab.plan.errors import PlanError

    mla_only = (args.kv_lora_rank, args.rope_dim, args.kv_cache_fraction)
    if args.pad_rope is not None and args.pad_latent is None:
        raise PlanError("--pad-rope widens the RoPE key of a padded latent: give --pad-latent R with it")
    if args.to != "mla":
        if any(v is not None for v in mla_only):
            raise PlanError("--kv-lora-rank, --kv-cache-fraction and --rope-dim need --to mla")
        if args.layout != "deepseek":
            raise PlanError("--layout needs --to mla")
        return False
    if args.kv_heads is not None:
        raise PlanError("--to mla and --kv-heads are separate conversions; run them one after the other")
    if (args.kv_lora_rank is None) == (args.kv_cache_fraction is None):
        raise PlanError("--to mla needs one of --kv-lora-rank R (or 'full') and --kv-cache-fraction F")
    if args.gguf:
        raise PlanError("--gguf writes Llama-family and Gemma 3 GGUF files; llama.cpp has no MLA for these")
    if args.pad_latent is not None and args.layout != "deepseek":
        raise PlanError("--pad-latent widens a DeepSeek-layout latent; --layout kvlab has none to pad")
    return True


def _plan(args: argparse.Namespace, config) -> tuple[int, int]:
    """(rank, rope_dim) of an MLA request, checked against the source before any work."""
    from kvlab.checkpoints import mla, mla_aware
    from kvlab.plan.errors import PlanError

    if args.layout == "kvlab":
        rope_dim = config.head_size if args.rope_dim is None else args.rope_dim
        rank = args.kv_lora_rank
        if args.kv_cache_fraction is not None:
            rank = round(args.kv_cache_fraction * 2 * config.kv_heads * config.head_size) - config.kv_heads * rope_dim
        if rank == "full":
            mla.check_mla_source(config, rope_dim)
            rank = mla.full_rank(config, rope_dim)
        mla.check_mla_request(config, rank, rope_dim)
        return rank, rope_dim
    if args.kv_cache_fraction is not None:
        rank, rope_dim = mla_aware.budget(config, args.kv_cache_fraction, args.rope_dim)
    else:
        rope_dim = config.head_size if args.rope_dim is None else args.rope_dim
        rank = args.kv_lora_rank
        if rank == "full":
            rank = min(2 * config.kv_heads * config.head_size, config.dim)
    mla_aware.check_request(config, rank, rope_dim)
    if args.pad_latent is not None and args.pad_latent < rank:
        raise PlanError(f"--pad-latent {args.pad_latent} is below the latent's {rank} channels")
    if args.pad_rope is not None and args.pad_rope % rope_dim:
        raise PlanError(f"--pad-rope {args.pad_rope} is not a multiple of the RoPE key's {rope_dim} channels")
    return rank, rope_dim


def _heads(model, args: argparse.Namespace, calibration, progress):
    """The KV-head conversion (or the model itself when none is asked) and, when aligned, its per-layer facts."""
    if args.kv_heads is None:
        return model, None
    from kvlab.checkpoints.convert import align_kv_heads, convert_kv_heads

    if calibration is not None:
        result = align_kv_heads(model, args.kv_heads, calibration.windows, progress)
        return result.model, result.layers
    return convert_kv_heads(model, args.kv_heads, args.method, args.seed), None


def _to_mla(model, layout: str, plan: tuple[int, int], calibration, progress):
    rank, rope_dim = plan
    if layout == "kvlab":
        from kvlab.checkpoints.mla import convert_to_mla
        conversion = convert_to_mla(model, rank, rope_dim)
    else:
        from kvlab.checkpoints.mla_aware import convert_to_mla_aware
        conversion = convert_to_mla_aware(model, rank, rope_dim, calibration.windows, progress)
    return conversion, conversion.model


def _mla_report(conversion, layout: str, after, before) -> dict:
    report = {"to": "mla", "layout": layout, "kv_lora_rank": after.kv_lora_rank, "rope_dim": after.qk_rope_head_dim,
              "rope_key_heads": after.rope_key_heads, "head_dim": before.head_size,
              "kept_energy_per_layer": list(conversion.kept_energy), "kept_energy_min": min(conversion.kept_energy)}
    if layout == "kvlab":
        report.update(full_rank=conversion.full_rank, exact=conversion.exact)
    else:
        report.update(exact=False, rope_theta=after.rope_base, rope_frequency_stride=conversion.rope_stride,
                      rope_energy_per_layer=list(conversion.rope_energy))
    return report


def _mla_line(report: dict, out: str, after, before) -> str:
    if report["layout"] == "kvlab":
        return (f"{report['source']} -> {out}: MLA (kvlab layout), latent rank {after.kv_lora_rank} of "
                f"{report['full_rank']}, {after.rope_key_heads} RoPE keys x {after.qk_rope_head_dim} of head dim "
                f"{before.head_size}; SVD energy kept {report['kept_energy_min']:.4f} (worst layer)"
                + ("; exact" if report["exact"] else "; approximate"))
    return (f"{report['source']} -> {out}: MLA (DeepSeek-V2 layout), latent rank {after.kv_lora_rank}, one shared "
            f"RoPE key of {after.qk_rope_head_dim} channels (every {report['rope_frequency_stride']} of the source's "
            f"frequencies); weighted K/V energy kept {report['kept_energy_min']:.4f} (worst layer)")
