"""A decode step over the engine's paged pool in one C call (rows at their own positions).

`paged_step_for(model, pool, max_rows)` returns a callable (ids [S], StepBatch) -> logits [S, V]
where the model and pool allow it, else None (the engine then runs module by module).
"""

from __future__ import annotations

from typing import Optional


def paged_step_for(model, pool, max_rows: int) -> Optional[object]:
    """The fused paged decode step for `model` on `pool`, or None where it cannot run."""
    return None
