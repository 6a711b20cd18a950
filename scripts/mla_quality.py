"""What `kvlab convert --to mla` costs in quality, per cached byte: perplexity at several ranks.

    python3 scripts/mla_quality.py stories260k --grid full:8,24:8,16:8,8:8,full:4,32:4,16:4,full:2,24:2 --kv-heads 2,1
    python3 scripts/mla_quality.py smollm2-135m --grid full:64,128:64,full:32,256:32,128:32,64:32 --kv-heads 1
    python3 scripts/mla_quality.py --render        # reports/mla-convert/README.md from the JSONs

Each grid entry is RANK:ROPE_DIM (RANK may be `full`); each model is converted in memory exactly
as the command converts it (kvlab.checkpoints.mla), with no uptraining, and scored through its
own cache (kvlab.evals.perplexity). `--kv-heads` adds the GQA paper's mean-pooled KV heads at
the same text as a reference of equal cache size. Results: reports/mla-convert/<model>.json
(with provenance), rendered into the README by `--render`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "reports" / "mla-convert"
TEXT = ROOT.parent / "shared" / "data" / "english" / "frankenstein.txt"


def measure(args: argparse.Namespace) -> dict:
    import torch

    from kvlab.bench.provenance import provenance
    from kvlab.checkpoints.convert import convert_kv_heads
    from kvlab.checkpoints.export import load_source
    from kvlab.checkpoints.mla import convert_to_mla, full_rank
    from kvlab.evals.perplexity import perplexity, text_windows
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_token

    torch.set_num_threads(args.threads)
    source = load_source(args.model)
    tokenizer = source.tokenizer
    ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"), add_bos=False)[args.offset:]
    windows = text_windows(ids, args.context, args.windows, tokenizer.bos_id if tokenizer.add_bos else None)
    fp16 = cache_formats("fp16")
    base = source.model.config
    base_bytes = kv_bytes_per_token(base.to_plan_spec(), fp16)

    def score(model) -> float:
        return perplexity(model.eval(), windows, lambda n: model.new_cache(1, n, "fp32"), args.chunk)["perplexity"]

    rows = []

    def add(label: str, model, **extra) -> None:
        started = time.perf_counter()
        ppl = score(model)
        spec = model.config.to_plan_spec()
        row = dict(label=label, perplexity=ppl, kv_bytes_per_token_fp16=kv_bytes_per_token(spec, fp16),
                   cache_fraction=kv_bytes_per_token(spec, fp16) / base_bytes,
                   seconds=round(time.perf_counter() - started, 2), **extra)
        rows.append(row)
        print(f"{label:>22}  ppl {ppl:9.3f}  KV {row['kv_bytes_per_token_fp16']:>7,} B/token "
              f"({row['cache_fraction']:.3f} of source)" +
              (f"  energy kept {extra['kept_energy_min']:.4f}" if "kept_energy_min" in extra else ""), flush=True)

    with torch.no_grad():
        add(f"source (GQA {base.kv_heads} KV)", source.model, kind="source")
        for heads in args.kv_heads:
            add(f"GQA mean-pool {heads} KV", convert_kv_heads(source.model, heads, "mean"), kind="gqa", kv_heads=heads)
        for entry in args.grid:
            rank_text, rope_text = entry.split(":")
            rope = int(rope_text)
            rank = full_rank(base, rope) if rank_text == "full" else int(rank_text)
            conversion = convert_to_mla(source.model, rank, rope)
            add(f"MLA r{rank} rope{rope}x{base.kv_heads}", conversion.model, kind="mla", kv_lora_rank=rank,
                rope_dim=rope, rope_key_heads=base.kv_heads, full_rank=conversion.full_rank, exact=conversion.exact,
                kept_energy_min=min(conversion.kept_energy),
                kept_energy_mean=sum(conversion.kept_energy) / len(conversion.kept_energy))
    return {"model": args.model, "source_path": source.path, "head_dim": base.head_size, "kv_heads": base.kv_heads,
            "layers": base.n_layers, "hidden": base.dim,
            "text": Path(args.text).name, "context": args.context, "windows": args.windows, "offset": args.offset,
            "chunk": args.chunk, "kv_cache_dtype_scored": "fp32", "rows": rows, "provenance": provenance(args.threads)}


def render() -> str:
    lines = ["# `kvlab convert --to mla`: perplexity against cached bytes, no uptraining", "",
             "Regenerate with `python3 scripts/mla_quality.py --render` after measuring "
             "(commands below, each under `flock /tmp/kvlab-heavy.lock`).", "",
             "Every row is a conversion of the same source scored on the same text through its own cache "
             "(fp32 cache; the KV bytes are what `kvlab plan` counts at fp16). `rRANK ropeD xG`: latent rank, "
             "RoPE channels each of the G source KV heads keeps. Full rank with D = head dim is exact; "
             "below that nothing was trained to recover, so these are the starting points an uptraining "
             "(`kvlab uptrain`) would begin from.", ""]
    for path in sorted(REPORT.glob("*.json")):
        data = json.loads(path.read_text())
        source = data["rows"][0]["perplexity"]
        lines += [f"## {data['model']} (head dim {data['head_dim']}, {data['kv_heads']} KV heads, "
                  f"{data['layers']} layers, hidden {data['hidden']})", "",
                  f"Text: {data['text']}, {data['windows']} window(s) of {data['context']} tokens after the first "
                  f"{data['offset']}. Command: `python3 scripts/{data['provenance']['command']}` "
                  f"(commit {str(data['provenance']['git_commit'])[:10]}, {data['provenance']['time_utc']}).", "",
                  "| conversion | KV B/token (fp16) | of source | SVD energy kept (worst layer) | perplexity | vs source |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in data["rows"]:
            energy = f"{row['kept_energy_min']:.4f}" if "kept_energy_min" in row else ""
            lines.append(f"| {row['label']}{' (exact)' if row.get('exact') else ''} | "
                         f"{row['kv_bytes_per_token_fp16']:,} | {row['cache_fraction']:.3f} | {energy} | "
                         f"{row['perplexity']:.3f} | {row['perplexity'] / source - 1:+.1%} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--grid", type=lambda s: s.split(","), default=[])
    parser.add_argument("--kv-heads", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--offset", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--render", action="store_true", help="write reports/mla-convert/README.md from the JSONs")
    args = parser.parse_args()
    from kvlab.files import write_json

    if args.model:
        result = measure(args)
        write_json(REPORT / f"{args.model}.json", result)
    if args.render or not args.model:
        text = render()
        tmp = REPORT / "README.md.tmp"
        tmp.write_text(text + "\n")
        tmp.replace(REPORT / "README.md")
        print(f"wrote {REPORT / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
