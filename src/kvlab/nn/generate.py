"""Autoregressive generation: one prefill over the prompt, then one token per step.

The decode loop is deliberately small (gpt-fast's shape): the cache is allocated once for
prompt + new tokens, each step feeds one token per sequence and asks only for the last
position's logits, and nothing else happens in Python between steps but sampling and the
streaming callback. Where the model and cache allow it (a Llama-family model on GGUF blocks,
a contiguous fp32/fp16/bf16 cache) each decode step is one C call (kvlab.nn.fused_decode);
`fused=False` keeps the module-by-module path.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from kvlab.nn.fused_decode import fused_step_for
from kvlab.nn.model import Decoder

TokenCallback = Callable[[torch.Tensor], None]


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids [B] from logits [B,V]: argmax at temperature 0, else softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
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
    prefill_end = time.perf_counter()
    fused_step = fused_step_for(model, cache) if fused else None
    decode = fused_step or (lambda ids: model(ids[:, None], cache, last_only=True)[:, -1])
    steps = 0
    for step in range(max_new_tokens):
        next_ids = sample(logits, temperature, top_k, generator)
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
