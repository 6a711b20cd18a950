"""What the engine hands back: vLLM's RequestOutput shape, and per-step deltas for streaming."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvlab.engine.sampling import Sampled


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list[Sampled]] = None


@dataclass
class RequestMetrics:
    arrival: float
    first_scheduled: Optional[float]
    first_token: Optional[float]
    last_token: Optional[float]
    num_cached_prompt_tokens: int
    preemptions: int


@dataclass
class RequestOutput:
    """One request's result so far (vLLM's names: outputs[i].text, .token_ids, .finish_reason; n outputs)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[list[Optional[Sampled]]] = None  # per prompt token (None first), when asked


@dataclass
class StepDelta:
    """What one step added to one request: new token ids and the text they complete."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Sampled] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
