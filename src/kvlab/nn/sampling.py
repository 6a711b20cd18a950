"""The one sampler: each row of a batch's logits drawn with its own settings, in vLLM's order.

The engine (kvlab.engine.sampling's SamplingParams, one per request) and the lab's decode loop
(kvlab.nn.generate) both draw here. A row's settings are any object with vLLM's fields
`temperature`, `top_k`, `top_p`, `min_p`, `logprobs` and a `greedy` flag. Greedy rows take the
argmax (deterministic); sampled rows apply temperature, then top_k, top_p and min_p to the scaled
distribution, and draw with the request's own generator when it set a seed (so a seeded request
gives the same text in any batch). Logprobs are of the distribution handed in (the engine passes
the logits before penalties and biases, as vLLM returns them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from kvlab.nn.threads import one_thread

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily


class RowSettings(Protocol):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    logprobs: Optional[int]

    @property
    def greedy(self) -> bool: ...


@dataclass
class Plain:
    """The lab's settings for every row (kvlab.nn.generate): temperature, top_k, top_p, nothing else."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus sampling's cut (Holtzman et al. 2019) on logits [..., V]: keep the smallest set of the likeliest
    tokens whose probability reaches top_p, the rest at -inf."""
    sorted_x, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly ahead of each token
    return logits.scatter(-1, order, sorted_x.masked_fill(before >= top_p, float("-inf")))


@dataclass
class Sampled:
    """One row's draw: the token, its log-probability and, when asked, the top-N alternatives."""

    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None
    rank: Optional[int] = None  # 1 + how many tokens were likelier (vLLM's Logprob.rank)


def filtered_logits(logits: torch.Tensor, params: RowSettings) -> torch.Tensor:
    """logits [V] scaled by temperature, with tokens outside top_k / top_p / min_p at -inf."""
    return cut_logits(logits.float() / params.temperature, params)


def cut_logits(x: torch.Tensor, params: RowSettings) -> torch.Tensor:
    """Temperature-scaled logits x [V] with tokens outside top_k / top_p / min_p at -inf: x itself
    where the request cuts nothing."""
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = top_p_filter(x, params.top_p)  # the smallest set of likeliest tokens whose mass reaches top_p
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x


@one_thread()
def sample_rows(logits: torch.Tensor, params: Sequence[RowSettings],
                generators: Sequence[Optional[torch.Generator]], default: torch.Generator,
                raw: Optional[torch.Tensor] = None) -> list[Sampled]:
    """One token per row of logits [S, V], each row with its own request's settings; log-probabilities
    from `raw` where given (the logits before penalties and biases: kvlab.engine.logits_process).

    The sampled rows are scaled and soft-maxed together, and the rows drawing from the engine's
    own generator (no seed of their own) draw in one call (`draw`), in row order. A seeded request
    draws alone, from its own generator. All on one thread (kvlab.nn.threads.one_thread)."""
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    greedy = [row for row, p in enumerate(params) if p.greedy]  # an argmax over the vocabulary for these alone
    tokens = [0] * len(params)
    if greedy:
        picks = logits.argmax(dim=-1) if not sampled else logits[greedy].argmax(dim=-1)
        for row, token in zip(greedy, picks.tolist()):
            tokens[row] = token
    if sampled:
        temperatures = torch.tensor([[params[row].temperature] for row in sampled], dtype=torch.float32)
        x = logits[sampled].float() / temperatures
        for i, row in enumerate(sampled):  # top_k / top_p / min_p, where a request asks for them
            scaled = x[i]
            cut = cut_logits(scaled, params[row])
            if cut is not scaled:
                x[i] = cut
        probs = torch.softmax(x, dim=-1)
        shared = [i for i, row in enumerate(sampled) if generators[row] is None]
        if shared:
            for i, token in zip(shared, draw(probs[shared], default)):
                tokens[sampled[i]] = token
        for i, row in enumerate(sampled):
            if generators[row] is not None:
                tokens[row] = draw(probs[i:i + 1], generators[row])[0]
    source = logits if raw is None else raw
    return [drawn(token, source[row], p) for row, (token, p) in enumerate(zip(tokens, params))]


def draw(weights: torch.Tensor, generator: Optional[torch.Generator]) -> list[int]:
    """One token per row of weights [R, V] (non-negative, in proportion to each token's probability),
    by inverting each row's cumulative sum at one uniform number from `generator`.

    Why not torch.multinomial: on the CPU it draws V exponentials per row (vLLM's exponential race),
    1.2 ms a row for SmolLM2's 49,152 tokens on one thread of an AMD EPYC and 19 ms for 16 rows,
    beside a 16-row decode step of about 40. A cumulative sum and a binary search cost 0.08 ms a
    row and draw from the same distribution (served at 16 requests with temperature 1.0: TPOT
    66.7 ms before, 45.0 after; README, "Side by side with peer servers")."""
    cdf = weights.double().cumsum(-1)
    uniforms = torch.rand(weights.shape[0], 1, dtype=torch.float64, generator=generator)
    return invert_cdf(cdf, uniforms)


def invert_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """Per row of cdf [R, V] (a running sum of non-negative weights), the first token whose running
    sum passes u x total for that row's u in [0, 1) (uniforms [R, 1]): a token of weight zero is
    never chosen. Where rounding puts u x total at the total itself, the last token of positive
    weight is (the first to reach the total)."""
    totals = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, uniforms * totals, right=True)
    last = torch.searchsorted(cdf, totals, right=False)
    return torch.minimum(picked, last)[:, 0].tolist()


def drawn(token: int, logits: torch.Tensor, params: RowSettings) -> Sampled:
    """`token` drawn from logits [V], with its log-probability and the top-N when the request asks."""
    sampled = Sampled(token)
    if params.logprobs is not None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        sampled.logprob = float(logp[token])
        sampled.rank = int((logp > logp[token]).sum()) + 1
        if params.logprobs:
            top = torch.topk(logp, params.logprobs)
            sampled.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
    return sampled
