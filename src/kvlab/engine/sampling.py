"""SamplingParams (vLLM's names and defaults) and the sampler that applies them per request.

Each request carries its own settings, so one step's batch may mix greedy and sampled rows.
Greedy rows take the argmax (deterministic); sampled rows apply temperature, then top_k,
top_p and min_p to the scaled distribution, in vLLM's order, and draw with the request's
own generator when it set a seed (so a seeded request gives the same text in any batch).
Logprobs are of the model's raw distribution (log_softmax of the logits), as vLLM returns;
under a grammar, of the masked distribution (vLLM applies the mask before its sampler).

The request-level extras that change the logits before this sampler runs (penalties,
logit_bias, min_tokens, grammar masks) live in kvlab.engine.logits_process; prompt
log-probabilities in kvlab.engine.prompt_logprobs; `n` in kvlab.engine.parallel_sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kvlab.engine.errors import RequestError
from kvlab.engine.structured import StructuredOutputsParams
# the sampler itself is the one kvlab.nn.sampling holds (the lab's decode loop draws there too)
from kvlab.nn.sampling import (SAMPLING_EPS, Sampled, cut_logits, draw, drawn, filtered_logits,  # noqa: F401
                               sample_rows)
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_N = 64  # samples per prompt: one request's samples always fit one batch of the default --max-num-seqs
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value; vLLM clamps to it, kvlab refuses beyond


@dataclass
class SamplingParams:
    """What one request asks for (vLLM's fields and defaults); `validate` raises RequestError naming the bad field."""

    n: int = 1  # independent samples of the prompt (kvlab.engine.parallel_sampling)
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-N log-probabilities per generated token
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # minus this for every token already generated (OpenAI: -2..2)
    frequency_penalty: float = 0.0  # minus this times each token's count in the output so far (-2..2)
    repetition_penalty: float = 1.0  # CTRL's: a prompt or output token's logit divided (if > 0) or multiplied by it
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit (-100..100)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings ignored, before this many tokens
    prompt_logprobs: Optional[int] = None  # each prompt token's log-probability and top-N (engine.prompt_logprobs)
    structured_outputs: Optional[StructuredOutputsParams] = None  # a grammar the output must follow
    guided_decoding: Optional[StructuredOutputsParams] = None  # vLLM's older name for structured_outputs

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise RequestError("give structured_outputs or guided_decoding (its older name), not both",
                                   "structured_outputs")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = _token_biases(self.logit_bias)
        self.validate()

    def validate(self) -> None:
        def bad(param: str, message: str) -> RequestError:
            return RequestError(f"{param} {message}", param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:  # NaN fails too
            raise bad("temperature", f"must be non-negative, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer from 0 to 20, got {self.logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer from 1 to {MAX_N}, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not (math.isfinite(self.repetition_penalty)
                                                                         and self.repetition_penalty > 0):
            raise bad("repetition_penalty", f"must be a positive number (1 = none), got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", f"must be an integer from 0 to 20, got {self.prompt_logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (or its fields as a dict)")

    @property
    def penalized(self) -> bool:
        """Whether presence, frequency or repetition penalties change this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether anything changes the logits before sampling (kvlab.engine.logits_process): False for
        a plain request, which then costs the step nothing extra."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.structured_outputs is not None

    @property
    def greedy(self) -> bool:
        """vLLM's rule: a temperature under 1e-5 is greedy (dividing by it would overflow to inf/NaN)."""
        return self.temperature < SAMPLING_EPS


def _token_biases(bias: dict) -> dict[int, float]:
    """logit_bias as OpenAI sends it (token ids as JSON strings) or as Python gives it (ints)."""
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if token < 0:
            raise RequestError(f"logit_bias token id {token} is negative", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
                -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {value!r} for token {token}",
                               "logit_bias")
        out[token] = float(value)
    return out
