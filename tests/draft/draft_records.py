"""Shared by the draft-head training tests: a random record of the shape kvlab.draft.features caches."""

import torch


def record(n: int, dim: int = 4, seed: int = 0) -> dict:
    """n positions of ids, the target's hidden states (fp16, as cached) and its greedy choices, vocabulary 10."""
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 10, (n,), generator=g, dtype=torch.int32),
            "hidden": torch.randn(n, dim, generator=g).half(),
            "choice": torch.randint(0, 10, (n,), generator=g, dtype=torch.int32)}
