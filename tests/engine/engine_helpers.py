"""Shared by the engine tests: a reference decode, an engine factory, and the pool-is-free check."""

from __future__ import annotations

import torch

from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.nn.generate import generate

PROMPTS = ["Once upon a time", "The cat sat on the mat and", "Lily and Ben went to the park. They saw a big",
           "One day", "Tom had a red ball. He liked to", "The sun was hot", "Mom said"]


def reference(model, tokenizer, prompt: str, max_tokens: int, kv_cache_dtype: str = "auto") -> list[int]:
    """`kvlab generate`'s greedy ids for one prompt (contiguous cache of the same KV format)."""
    ids = tokenizer.encode(prompt)
    cache = model.new_cache(1, len(ids) + max_tokens, kv_cache_dtype=kv_cache_dtype)
    return generate(model, ids, max_tokens, stop_ids=[tokenizer.eos_id], cache=cache)[0].tolist()


def make_engine(model, tokenizer, **config) -> LLMEngine:
    config.setdefault("kv_cache_memory", 400_000)
    config.setdefault("block_size", 16)  # small blocks: short test prompts still cross block boundaries
    config.setdefault("paged_step", False)
    return LLMEngine(model, tokenizer, EngineConfig(**config))


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def assert_pool_free(engine: LLMEngine) -> None:
    """Every block back in the free queue, no references left, no request left behind."""
    blocks = engine.blocks
    assert blocks.num_free == blocks.num_blocks
    assert all(b.ref_count == 0 for b in blocks.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


def collect(deltas, into: dict[str, list[int]]) -> dict[str, list[int]]:
    for delta in deltas:
        into.setdefault(delta.request_id, []).extend(delta.token_ids)
    return into


def run_all(engine: LLMEngine, got: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Step until done; every request's ids (added to `got`, what earlier steps produced)."""
    with torch.inference_mode():
        return collect(engine.run_until_done(), got if got is not None else {})


TIE = 0.01  # logits within this are a tie that float summation order may break either way


def first_divergence_is_a_tie(model, tokenizer, prompt: str, got: list[int], want: list[int],
                              kv_cache_dtype: str = "auto") -> bool:
    """True when `got` equals `want`, or first differs where the reference's two candidates tie.

    The engine packs many sequences into one matrix product where `kvlab generate` runs one:
    the same arithmetic in another summation order, so logits can differ in the last bits, and
    with an int8 cache a last-bit difference can move a code. Where two tokens' logits are within
    TIE (plus, on a rounding cache, what that cache's rounding moves their margin by), either is
    the greedy answer; anywhere else the outputs must be identical.
    """
    if got == want:
        return True
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if at is None:  # one is a prefix of the other: a tie on EOS
        at = min(len(got), len(want))
        if at >= len(got) or at >= len(want):
            return False
    ids = tokenizer.encode(prompt) + want[:at]

    def margin(dtype: str) -> float:
        """The reference's lead of `want`'s token over `got`'s at the divergence, on a `dtype` cache."""
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), model.new_cache(1, len(ids), kv_cache_dtype=dtype))[0, -1]
        return float(logits[want[at]] - logits[got[at]])

    lead = margin(kv_cache_dtype)
    # A rounding cache (int8, fp16) moves the reference's own margin; where that move is larger
    # than the margin, the cache's rounding decided the token, not the engine.
    rounding = 0.0 if kv_cache_dtype in ("auto", "fp32") else abs(lead - margin("auto"))
    return abs(lead) < TIE + rounding


def assert_outputs_match(model, tokenizer, prompts: dict[str, tuple[str, list[int]]], got: dict[str, list[int]],
                         kv_cache_dtype: str = "auto") -> None:
    """Every request's ids equal the reference's, up to a near tie (see first_divergence_is_a_tie)."""
    for request_id, (prompt, want) in prompts.items():
        assert first_divergence_is_a_tie(model, tokenizer, prompt, got.get(request_id, []), want, kv_cache_dtype), \
            (request_id, got.get(request_id), want)
