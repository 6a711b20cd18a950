"""Batch-1 greedy decode speed: kvlab against transformers `generate`, same weights, same run.

    kvlab bench decode MODEL --batch-1-race [--json PATH] [--new-tokens 128] [--repeats 3]

`kvlab bench decode` without --batch-1-race sweeps batch and context (kvlab.bench.decode_sweep).

Both load SmolLM2-135M-Instruct from the same Q4_1 GGUF (transformers with `gguf_file=`),
take the same prompt (24 tokens with SmolLM2's tokenizer; at most 32 are kept) and produce exactly `--new-tokens` tokens greedily; each
timing covers prefill and decode, as a user waiting for the text sees them. The result is the
median of `--repeats` runs after one warm-up, the engines taking turns so that load from
other processes on a shared machine falls on all of them alike. kvlab computes on the file's
Q4_1/Q8_0 blocks (`--kvlab-weights gguf`, the default), on PyTorch's int4 kernel (`int4`) or
on dequantised fp32 matrices (`dense`), and runs twice: with its decode steps fused into one C
call each where the model allows (kvlab.nn.c_model), and module by module. transformers
runs in fp32 (what it loads by default) and bf16; the ratio is the first kvlab run's against
the faster of the two.
"""

from __future__ import annotations

import os
import statistics
import time
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from kvlab.bench.provenance import provenance
from kvlab.checkpoints.resolve import PACKINGS, load_checkpoint, resolve_model_path
from kvlab.files import write_json
from kvlab.nn.generate import generate
from kvlab.train.progress import progress_bar

PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each step, and at the "
          "top he lit the lamp that")


class KvlabEngine:
    """kvlab's `generate`, keeping each call's prefill / decode split (the timed runs' are reported)."""

    def __init__(self, loaded, prompt: list[int], new_tokens: int, paged_step: bool):
        self.loaded, self.prompt, self.new_tokens, self.paged_step = loaded, prompt, new_tokens, paged_step
        self.splits: list[dict] = []

    def __call__(self) -> list[int]:
        stats: dict = {}
        ids = generate(self.loaded.model, self.prompt, self.new_tokens, paged_step=self.paged_step, stats=stats)
        self.splits.append(stats)
        return ids[0].tolist()


def transformers_engine(path: str, prompt: list[int], new_tokens: int, dtype: torch.dtype) -> Callable[[], list[int]]:
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype).eval()
    ids = torch.tensor([prompt])

    def run() -> list[int]:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()

    return run


def race(engines: dict[str, Callable[[], list[int]]], repeats: int) -> dict[str, dict]:
    """Warm each engine up, then time them in turns, so load from other processes hits all alike."""
    bar = progress_bar(len(engines) * (repeats + 1), "decode runs", unit="run")
    results = {}
    for name, run in engines.items():
        results[name] = {"engine": name, "seconds": [], "ids": run()}
        bar.update()
    for _ in range(repeats):
        for name, run in engines.items():
            start = time.perf_counter()
            run()
            results[name]["seconds"].append(time.perf_counter() - start)
            bar.update()
    bar.close()
    return results


def run_race(model: str = "smollm2-135m", new_tokens: int = 128, repeats: int = 3, threads: Optional[int] = None,
             kvlab_weights: str = "gguf", transformers: bool = True, json_path: Optional[str] = None) -> int:
    """The race `kvlab bench decode MODEL --batch-1-race` runs (its flags: kvlab.commands.bench_decode_cmd)."""
    if kvlab_weights not in PACKINGS:
        raise ValueError(f"kvlab_weights must be one of {PACKINGS}, got {kvlab_weights!r}")
    args = SimpleNamespace(model=model, new_tokens=new_tokens, repeats=repeats, threads=threads,
                           kvlab_weights=kvlab_weights, skip_transformers=not transformers, json=json_path)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    loaded = load_checkpoint(args.model, torch.float32, args.kvlab_weights)
    prompt = loaded.tokenizer.encode(PROMPT)[:32]
    stats: dict = {}
    generate(loaded.model, prompt, 2, stats=stats)
    weights = f"{args.kvlab_weights} weights"
    engines = {f"kvlab ({weights}, {'fused decode step' if stats['paged_step'] else 'module path'})":
               KvlabEngine(loaded, prompt, args.new_tokens, paged_step=True)}
    if stats["paged_step"]:
        engines[f"kvlab ({weights}, module path)"] = KvlabEngine(loaded, prompt, args.new_tokens, paged_step=False)
    if not args.skip_transformers:
        for dtype in (torch.float32, torch.bfloat16):
            name = f"transformers generate ({str(dtype).removeprefix('torch.')})"
            engines[name] = transformers_engine(path, prompt, args.new_tokens, dtype)
    runs = list(race(engines, args.repeats).values())
    for run in runs:
        assert len(run["ids"]) == args.new_tokens, run["engine"]
        run["tokens_per_s"] = args.new_tokens / statistics.median(run["seconds"])
        run["best_tokens_per_s"] = args.new_tokens / min(run["seconds"])
        line = f"{run['engine']}: {run['tokens_per_s']:.1f} tok/s (median), {run['best_tokens_per_s']:.1f} (best)"
        engine = engines[run["engine"]]
        if isinstance(engine, KvlabEngine):  # the timed runs' split; the first call was the warm-up
            timed = engine.splits[-args.repeats:]
            run["prefill_seconds"] = [split["prefill_s"] for split in timed]
            run["decode_seconds"] = [split["decode_s"] for split in timed]
            run["decode_only_tokens_per_s"] = timed[0]["decode_steps"] / statistics.median(run["decode_seconds"])
            line += (f"; prefill {1000 * statistics.median(run['prefill_seconds']):.0f} ms, decode alone "
                     f"{run['decode_only_tokens_per_s']:.1f} tok/s")
        print(line)
    result = {"benchmark": "decode_speed", "model": args.model, "weights": loaded.model.packing,
              "prompt_tokens": len(prompt),
              "new_tokens": args.new_tokens, "repeats": args.repeats, "statistic": "median of the repeats",
              "runs": runs, "provenance": provenance(args.threads)}
    theirs = [run for run in runs if run["engine"].startswith("transformers")]
    if theirs:
        ours, best, fp32 = runs[0], max(theirs, key=lambda run: run["tokens_per_s"]), theirs[0]
        result["ratio_vs_best_transformers"] = ours["tokens_per_s"] / best["tokens_per_s"]
        result["ratio_vs_transformers_fp32"] = ours["tokens_per_s"] / fp32["tokens_per_s"]
        result["greedy_prefix_matching_transformers_fp32"] = next(
            (i for i, (a, b) in enumerate(zip(ours["ids"], fp32["ids"])) if a != b), args.new_tokens)
        print(f"kvlab / transformers: {result['ratio_vs_best_transformers']:.2f}x the faster transformers run "
              f"({best['engine']}); {result['ratio_vs_transformers_fp32']:.2f}x transformers fp32")
    if args.json:
        write_json(args.json, result)
    return 0
