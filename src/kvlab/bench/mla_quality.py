"""What `kvlab convert --to mla` costs in quality, per cached byte: perplexity at several ranks.

`kvlab bench mla-quality MODEL --grid RANK:ROPE,... [--kv-heads G,...]`: each grid entry is
RANK:ROPE_DIM (RANK may be `full`); the model is converted in memory exactly as the command
converts it (kvlab.checkpoints.mla), with no uptraining, and scored through its own cache
(kvlab.evals.perplexity). `--kv-heads` adds the GQA paper's mean-pooled KV heads at the same text
as a reference of equal cache size. The result is reports/mla-convert/<model>.json (with
provenance); kvlab.report.mla_convert renders the folder's page.
"""

from __future__ import annotations

import time
from pathlib import Path


def measure(model: str, grid: list[tuple[str, int]], kv_heads: list[int], text: Path, context: int,
            windows: int, offset: int, chunk: int, threads: int) -> dict:
    """Perplexity and fp16 KV bytes per token of the source, its mean-pooled GQA variants and each MLA
    conversion in `grid`, on the same windows of `text`; printed as each row finishes."""
    import torch

    from kvlab.bench.provenance import provenance
    from kvlab.checkpoints.convert import convert_kv_heads
    from kvlab.checkpoints.export import load_source
    from kvlab.checkpoints.mla import convert_to_mla, full_rank
    from kvlab.evals.perplexity import perplexity, text_windows
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_token

    torch.set_num_threads(threads)
    source = load_source(model)
    tokenizer = source.tokenizer
    ids = tokenizer.encode(Path(text).read_text(encoding="utf-8"), add_bos=False)[offset:]
    scored = text_windows(ids, context, windows, tokenizer.bos_id if tokenizer.add_bos else None)
    fp16 = cache_formats("fp16")
    base = source.model.config
    base_bytes = kv_bytes_per_token(base.to_plan_spec(), fp16)

    def score(net) -> float:
        return perplexity(net.eval(), scored, lambda n: net.new_cache(1, n, "fp32"), chunk)["perplexity"]

    rows = []

    def add(label: str, net, **extra) -> None:
        started = time.perf_counter()
        ppl = score(net)
        spec = net.config.to_plan_spec()
        row = dict(label=label, perplexity=ppl, kv_bytes_per_token_fp16=kv_bytes_per_token(spec, fp16),
                   cache_fraction=kv_bytes_per_token(spec, fp16) / base_bytes,
                   seconds=round(time.perf_counter() - started, 2), **extra)
        rows.append(row)
        print(f"{label:>22}  ppl {ppl:9.3f}  KV {row['kv_bytes_per_token_fp16']:>7,} B/token "
              f"({row['cache_fraction']:.3f} of source)" +
              (f"  energy kept {extra['kept_energy_min']:.4f}" if "kept_energy_min" in extra else ""), flush=True)

    with torch.no_grad():
        add(f"source (GQA {base.kv_heads} KV)", source.model, kind="source")
        for heads in kv_heads:
            add(f"GQA mean-pool {heads} KV", convert_kv_heads(source.model, heads, "mean"), kind="gqa", kv_heads=heads)
        for rank_text, rope in grid:
            rank = full_rank(base, rope) if rank_text == "full" else int(rank_text)
            conversion = convert_to_mla(source.model, rank, rope)
            add(f"MLA r{rank} rope{rope}x{base.kv_heads}", conversion.model, kind="mla", kv_lora_rank=rank,
                rope_dim=rope, rope_key_heads=base.kv_heads, full_rank=conversion.full_rank, exact=conversion.exact,
                kept_energy_min=min(conversion.kept_energy),
                kept_energy_mean=sum(conversion.kept_energy) / len(conversion.kept_energy))
    return {"model": model, "source_path": source.path, "head_dim": base.head_size, "kv_heads": base.kv_heads,
            "layers": base.n_layers, "hidden": base.dim,
            "text": Path(text).name, "context": context, "windows": windows, "offset": offset,
            "chunk": chunk, "kv_cache_dtype_scored": "fp32", "rows": rows, "provenance": provenance(threads)}
