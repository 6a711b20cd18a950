"""Time to first token with and without the prefix cache, for a shared system prompt (the seeds' robot).

    kvlab bench prefix-ttft [--model smollm2-135m] [--prefix-tokens 512] [--requests 6] [--json PATH]

One long instruction prefix is sent with every request, each with its own short suffix. With
prefix caching on, the first request computes the prefix and the later ones find its full
blocks in the cache, so their prefill reads only the suffix; with it off, every request
prefills the whole prompt. Requests go one at a time (TTFT, not queueing, is measured), the
two engines take turns, and the figure is the median over the requests after the first.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvlab.bench.provenance import provenance
from kvlab.bench.throughput import random_prompts
from kvlab.engine.engine import EngineConfig, LLMEngine
from kvlab.engine.llm import load_for_engine
from kvlab.engine.sampling import SamplingParams
from kvlab.files import write_json


def ttft_once(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from arrival to the first token of one request alone, and the prompt tokens served from cache."""
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    with torch.inference_mode():
        while not seq.finished:
            engine.step()
    return seq.first_token_time - seq.arrival, seq.num_cached_prompt


def run_command(args: argparse.Namespace) -> int:
    """`kvlab bench prefix-ttft`: one shared prefix, with and without prefix caching; prints and writes --json."""
    model, tokenizer = load_for_engine(args.model, threads=args.threads)
    vocab = model.config.vocab_size
    prefix = random_prompts(1, args.prefix_tokens, vocab, 1)[0]
    suffixes = random_prompts(args.requests, args.suffix_tokens, vocab, 2)
    engines = {on: LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=256 << 20, enable_prefix_caching=on))
               for on in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    cached: dict[bool, list[int]] = {True: [], False: []}
    for suffix in suffixes:
        for on, engine in engines.items():
            seconds, hits = ttft_once(engine, prefix + suffix)
            times[on].append(seconds)
            cached[on].append(hits)
    result = {"benchmark": "prefix_ttft", "model": args.model, "prefix_tokens": args.prefix_tokens,
              "suffix_tokens": args.suffix_tokens, "requests": args.requests,
              "ttft_s": {"prefix_caching": times[True], "no_prefix_caching": times[False]},
              "cached_prompt_tokens": {"prefix_caching": cached[True], "no_prefix_caching": cached[False]},
              "median_ttft_after_first_s": {k: statistics.median(v[1:]) for k, v in
                                            (("prefix_caching", times[True]), ("no_prefix_caching", times[False]))},
              "provenance": provenance(args.threads)}
    med = result["median_ttft_after_first_s"]
    result["speedup"] = med["no_prefix_caching"] / med["prefix_caching"]
    print(f"TTFT with a shared {args.prefix_tokens}-token prefix, median of requests 2..{args.requests}: "
          f"{1000 * med['prefix_caching']:.0f} ms with prefix caching ({cached[True][-1]} prompt tokens from the "
          f"cache), {1000 * med['no_prefix_caching']:.0f} ms without: {result['speedup']:.1f}x")
    if args.json:
        write_json(args.json, result)
    return 0
