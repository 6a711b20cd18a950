"""Autoregressive generation: one prefill over the prompt, then one token per step.

The decode loop is deliberately small (gpt-fast's shape): the cache is allocated once for
prompt + new tokens, each step feeds one token per sequence and asks only for the last
position's logits, and nothing else happens in Python between steps but sampling and the
streaming callback. Where the model and cache allow it (a Llama-family model on GGUF blocks,
a contiguous fp32/fp16/bf16 cache) each decode step is one C call (kvlab.nn.fused_decode);
`fused=False` keeps the module-by-module path. A `KVPool` passed as the cache (the engine's
paged pool, which also holds fp8 and int8) gives each sequence consecutive blocks and decodes
with the paged C step (kvlab.nn.paged_decode): the one C path for the narrow formats, which
the contiguous step does not read.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from kvlab.cache.base import CacheError
from kvlab.cache.pool import DEFAULT_BLOCK_SIZE, KVPool
from kvlab.cache.step import StepBatch
from kvlab.errors import KvlabError
from kvlab.nn.fused_decode import fused_step_for
from kvlab.nn.model import Decoder
from kvlab.nn.paged_decode import paged_step_for, why_not_paged

TokenCallback = Callable[[torch.Tensor], None]
CONTIGUOUS_C_FORMATS = ("auto", "fp32", "fp16", "bf16")  # what kvlab.nn.fused_decode reads in place


def cache_for_generation(model: Decoder, batch: int, capacity: int, kv_cache_dtype: str = "auto"):
    """The cache `generate` decodes fastest on: for formats the contiguous C step does not read
    (fp8, int8), a KVPool of `batch` x `capacity` tokens where the paged C step runs this model
    on it (its blocks, the engine's DEFAULT_BLOCK_SIZE, round the capacity up); otherwise model.new_cache."""
    if kv_cache_dtype not in CONTIGUOUS_C_FORMATS:
        try:
            pool = KVPool.for_model(model.config, batch * -(-capacity // DEFAULT_BLOCK_SIZE), DEFAULT_BLOCK_SIZE,
                                    kv_cache_dtype)
        except (CacheError, KvlabError):  # not a format the pool pages: the contiguous caches say why, if at all
            pool = None
        if pool is not None and why_not_paged(model, pool) is None:
            return pool
    return model.new_cache(batch, capacity, kv_cache_dtype)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus sampling's cut (Holtzman et al. 2019) on logits [..., V]: keep the smallest set of the likeliest
    tokens whose probability reaches top_p, the rest at -inf (the engine's sampler uses this one too)."""
    sorted_x, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly ahead of each token
    return logits.scatter(-1, order, sorted_x.masked_fill(before >= top_p, float("-inf")))


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           generator: Optional[torch.Generator] = None, top_p: float = 1.0) -> torch.Tensor:
    """Next token ids [B] from logits [B,V]: argmax at temperature 0, else softmax(logits / T) cut to top_k, top_p."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model: Decoder,
    prompt: Union[Sequence[int], torch.Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    cache=None,
    stop_ids: Iterable[int] = (),
    on_token: Optional[TokenCallback] = None,
    stats: Optional[dict] = None,
    fused: bool = True,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Continue `prompt` (ids, or [B,T] for a batch) by up to `max_new_tokens`; returns [B, new].

    `on_token` is called with each step's ids [B] as soon as they exist (streaming). Generation
    stops early once every sequence has produced one of `stop_ids` (that token included).
    """
    tokens = torch.as_tensor(prompt, dtype=torch.long)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.shape[1] == 0:
        raise ValueError("generation needs at least one prompt token (a BOS token will do)")
    batch = tokens.shape[0]
    if max_new_tokens <= 0:
        return tokens.new_zeros((batch, 0))
    if cache is None:  # the last token is sampled, never fed back: it needs no cache slot
        cache = model.new_cache(batch, tokens.shape[1] + max_new_tokens - 1)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
    finished = torch.zeros(batch, dtype=torch.bool)
    out = []
    start = time.perf_counter()
    if isinstance(cache, KVPool):
        prefill, decode, fused_step = _pooled(model, cache, tokens, max_new_tokens, fused)
        logits = prefill()
    else:
        logits = model(tokens, cache, last_only=True)[:, -1]
        fused_step = fused_step_for(model, cache) if fused else None
        decode = fused_step or (lambda ids: model(ids[:, None], cache, last_only=True)[:, -1])
    prefill_end = time.perf_counter()
    steps = 0
    for step in range(max_new_tokens):
        next_ids = sample(logits, temperature, top_k, generator, top_p)
        out.append(next_ids)
        if on_token is not None:
            on_token(next_ids)
        if len(stops):
            finished |= torch.isin(next_ids, stops)
            if bool(finished.all()):
                break
        if step + 1 < max_new_tokens:
            logits = decode(next_ids)
            steps += 1
    if stats is not None:
        stats.update(prefill_s=prefill_end - start, decode_s=time.perf_counter() - prefill_end, decode_steps=steps,
                     fused_decode=fused_step is not None)
    return torch.stack(out, dim=1) if out else tokens.new_zeros((batch, 0))


def _pooled(model: Decoder, pool: KVPool, tokens: torch.Tensor, max_new_tokens: int, fused: bool):
    """(prefill() -> logits [B, V], decode(ids [B]) -> logits [B, V], the C step or None) for
    sequences `tokens` [B, T] in `pool`, sequence b in blocks b n .. b n + n - 1."""
    batch, prompt_len = tokens.shape
    capacity = prompt_len + max_new_tokens - 1
    per_row = -(-capacity // pool.block_size)
    if batch * per_row > pool.num_blocks:
        raise ValueError(f"{batch} sequences of {capacity} tokens need {batch * per_row} blocks of "
                         f"{pool.block_size}; the pool has {pool.num_blocks}")
    tables = [list(range(b * per_row, (b + 1) * per_row)) for b in range(batch)]
    fed = [prompt_len] * batch  # tokens each sequence holds

    def prefill() -> torch.Tensor:
        step = StepBatch.build([0] * batch, [prompt_len] * batch, tables, pool.block_size)
        return model(tokens.reshape(1, -1), pool, last_only=True, step=step)[0]

    c_step = paged_step_for(model, pool, batch) if fused else None

    def decode(ids: torch.Tensor) -> torch.Tensor:
        step = StepBatch.build(list(fed), [1] * batch, tables, pool.block_size)
        for b in range(batch):
            fed[b] += 1
        if c_step is not None:
            return c_step(ids, step)
        return model(ids[None], pool, last_only=True, step=step)[0]

    return prefill, decode, c_step
