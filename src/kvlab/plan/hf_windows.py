"""Which layers of a config.json model attend through a sliding window.

Families say it four ways: an explicit `layer_types` list (newer transformers saves one
for every family that mixes kinds), a period (Gemma 3's `sliding_window_pattern`: every
Nth layer is global), a fixed alternation (Gemma 2, gpt-oss), or a single window for all
layers (Mistral, Phi-3, StarCoder2). An explicit list always wins, as in transformers.
"""

from __future__ import annotations

from typing import Callable, Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.hf_fields import Fields

Windows = tuple[Optional[int], ...]
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def per_layer(f: Fields, layers: int, window: Optional[int], is_sliding: Callable[[int], bool]) -> Windows:
    """Each layer's window: `layer_types` when stated, else `is_sliding(index)`.

    A layer typed sliding while the model has no window (Qwen2 with
    `use_sliding_window: false`) attends fully, which is what transformers runs.
    """
    types = f.config.get("layer_types")
    if types is None:
        sliding = [is_sliding(index) for index in range(layers)]
    else:
        if not isinstance(types, list) or len(types) != layers:
            raise PlanError(f"layer_types must list one type for each of the {layers} layers")
        unknown = sorted({repr(kind) for kind in types if not isinstance(kind, str) or kind not in _LAYER_TYPES})
        if unknown:
            raise PlanError(f"unsupported layer_types {', '.join(unknown)}; "
                            "expected full_attention or sliding_attention")
        sliding = [_LAYER_TYPES[kind] for kind in types]
    return tuple(window if is_window and window else None for is_window in sliding)


def every_layer(layers: int, window: Optional[int]) -> Windows:
    """One window for the whole model (Mistral, Phi-3, StarCoder2), or none when it is null."""
    return (window,) * layers


def periodic(f: Fields, layers: int, window: Optional[int], period: int) -> Windows:
    """Every `period`-th layer global, the rest windowed (Gemma 2: 2, Gemma 3: 6, gpt-oss: 2)."""
    return per_layer(f, layers, window, lambda index: (index + 1) % period != 0)


def after(f: Fields, layers: int, window: Optional[int], first_windowed: int) -> Windows:
    """Qwen2/Qwen3: the first `max_window_layers` layers global, later ones windowed."""
    return per_layer(f, layers, window, lambda index: index >= first_windowed)


def window_if(f: Fields, switch: str) -> Optional[int]:
    """`sliding_window` when the `switch` flag (`use_sliding_window`) is on, else None."""
    return f.optional_size("sliding_window") if f.flag(switch) else None
