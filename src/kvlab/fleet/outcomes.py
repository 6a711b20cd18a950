"""What happened to each request and to each replica's pool over time (filled by the replicas)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Outcomes:
    """Per request (indexed like kvlab.fleet.workload.Requests): times in seconds of virtual clock."""

    first_token: np.ndarray
    finish: np.ndarray
    preemptions: np.ndarray
    cached_tokens: np.ndarray
    replica: np.ndarray
    rejected: np.ndarray
    timeline: list[tuple[float, int, float, int, int, int]] = field(default_factory=list)
    # (time, replica, KV usage, running, waiting, preemptions so far)
    steps: int = 0
    # speculative decoding, vLLM's counters (kvlab.engine.speculative.SpecStats): verifications, drafted, accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @classmethod
    def empty(cls, n: int) -> "Outcomes":
        return cls(np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, np.int32), np.zeros(n, np.int64),
                   np.full(n, -1, np.int32), np.zeros(n, bool))
