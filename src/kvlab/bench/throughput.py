"""Offline throughput through the engine, after `vllm bench throughput`: N random prompts, all at once.

Prompts are random token ids (vLLM's "random" dataset) of `input_len` tokens, each asking for
exactly `output_len` tokens (ignore_eos), so every engine does the same work. Figures:
requests/s, output tokens/s and total tokens/s over the wall time from the first request to
the last token. Beside the batched run, the same command can run kvlab at one request at a
time and plain `kvlab.nn.generate` (batch 1), in one process and one run, so the ratios
compare like with like. Like with like also means the same work: the warm-up and the
baselines get prompts of their own, never the batched run's, so no run finds its prompt in
the prefix cache and skips its prefill (`prefix_cached_tokens` in each run's figures says so).
"""

from __future__ import annotations

import random
import time
from typing import Optional

import torch

from kvlab.engine.engine import LLMEngine
from kvlab.engine.sampling import SamplingParams


def special_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's BOS and EOS ids (those it has): what random prompts must not contain."""
    return tuple(t for t in (getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)) if t is not None)


def random_prompts(num: int, input_len: int, vocab: int, seed: int, special: tuple[int, ...] = ()) -> list[list[int]]:
    """`num` prompts of `input_len` random ids (avoiding special ids), reproducible from `seed`."""
    rng = random.Random(seed)
    usable = [t for t in range(min(vocab, 32_000)) if t not in special]
    return [[rng.choice(usable) for _ in range(input_len)] for _ in range(num)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: Optional[int] = None,
               progress=None) -> dict:
    """All prompts through `engine`, at most `concurrency` in flight (None: all at once)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pending = list(prompts)
    limit = concurrency or len(prompts)
    in_flight, finished, output_tokens = 0, 0, 0
    hits_before = engine.blocks.prefix_hits
    started = time.perf_counter()
    first_token: dict[str, float] = {}
    with torch.inference_mode():
        while pending or engine.has_unfinished():
            while pending and in_flight < limit:
                engine.add_request(pending.pop(0), params)
                in_flight += 1
            for delta in engine.step():
                output_tokens += len(delta.token_ids)
                first_token.setdefault(delta.request_id, time.perf_counter() - started)
                if delta.finished:
                    in_flight -= 1
                    finished += 1
                    if progress is not None:
                        progress.update()
    elapsed = time.perf_counter() - started
    total_in = sum(len(p) for p in prompts)
    return {"concurrency": limit, "num_requests": finished, "elapsed_s": elapsed,
            "requests_per_s": finished / elapsed, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / elapsed, "total_tokens_per_s": (output_tokens + total_in) / elapsed,
            "mean_ttft_s": sum(first_token.values()) / max(1, len(first_token)),
            "preemptions": engine.scheduler.num_preemptions, "decode_path": engine.decode_path,
            "prefix_cached_tokens": engine.blocks.prefix_hits - hits_before}


def run_generate(model, prompt: list[int], output_len: int) -> dict:
    """Plain `kvlab.nn.generate` on one prompt (what `kvlab generate` does): the batch-1 baseline."""
    from kvlab.nn.generate import generate

    cache = model.new_cache(1, len(prompt) + output_len)
    stats: dict = {}
    started = time.perf_counter()
    out = generate(model, prompt, output_len, cache=cache, stats=stats)
    elapsed = time.perf_counter() - started
    return {"elapsed_s": elapsed, "output_tokens": out.shape[1], "output_tokens_per_s": out.shape[1] / elapsed,
            "paged_step": stats["paged_step"]}
