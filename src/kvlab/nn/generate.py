"""Autoregressive generation for the lab: one prefill over the prompt, then one token per step.

The decode loop is deliberately small (gpt-fast's shape): the cache is allocated once for
prompt + new tokens, each step feeds one token per sequence and asks only for the last
position's logits, and nothing else happens in Python between steps but sampling and the
streaming callback. The cache is the lab's batch of rows on the engine's pool
(kvlab.cache.PooledRows, `model.new_cache`): the forward is the engine's step, and where the C
step runs the model on that pool (kvlab.nn.paged_decode) each decode step is one C call;
`paged_step=False` keeps the module-by-module path. A reference cache (`model.reference_cache`)
runs module by module. The commands users run (`kvlab generate`, `measure`, `serve`) decode
through the engine itself; this loop serves the lab's studies and the tests' references.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from kvlab.cache.pooled_rows import PooledRows
from kvlab.nn.model import Decoder
from kvlab.nn.paged_decode import paged_step_for
from kvlab.nn.sampling import Plain, sample_rows
from kvlab.nn.threads import ThreadGovernor

TokenCallback = Callable[[torch.Tensor], None]


def cache_for_generation(model: Decoder, batch: int, capacity: int, kv_cache_dtype: str = "auto"):
    """The cache `generate` decodes on: the lab's rows on the engine's pool (`model.new_cache`)."""
    return model.new_cache(batch, capacity, kv_cache_dtype)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           generator: Optional[torch.Generator] = None, top_p: float = 1.0) -> torch.Tensor:
    """Next token ids [B] from logits [B,V], every row with the same settings, by the one sampler
    (kvlab.nn.sampling, which the engine uses too): argmax at temperature 0, else softmax(logits / T)
    cut to top_k and top_p."""
    settings = Plain(temperature, top_k or 0, top_p)
    rows = logits.shape[0]
    drawn = sample_rows(logits, [settings] * rows, [None] * rows, generator or torch.default_generator)
    return torch.tensor([d.token_id for d in drawn], dtype=torch.long)


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
    paged_step: bool = True,
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
    logits = model(tokens, cache, last_only=True)[:, -1]
    c_step = paged_step_for(model, cache.pool, batch) if paged_step and isinstance(cache, PooledRows) else None

    def decode(ids: torch.Tensor) -> torch.Tensor:
        if c_step is None:
            return model(ids[:, None], cache, last_only=True)[:, -1]
        step = cache.step(1)
        logits = c_step(ids, step)
        cache.advance(1)
        return logits

    prefill_end = time.perf_counter()
    threads = ThreadGovernor()  # all threads on a quiet machine, one when the cores are shared
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
            with threads.step(batch):
                logits = decode(next_ids)
            steps += 1
    if stats is not None:
        stats.update(prefill_s=prefill_end - start, decode_s=time.perf_counter() - prefill_end, decode_steps=steps,
                     paged_step=c_step is not None)
    return torch.stack(out, dim=1) if out else tokens.new_zeros((batch, 0))
