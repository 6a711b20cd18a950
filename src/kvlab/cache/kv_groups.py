"""KV-cache groups: which layers share a block table, and which past positions their queries see.

One pool serves every attention design by grouping layers by kind, as vLLM's hybrid KV-cache
manager does (kvlab.plan.vllm_blocks.kv_groups holds the grouping rule; the pool lays its
tensors out from it, so its bytes are the plan's):
- full attention (MLA's latent rows included): a query at position t sees every p <= t;
- a sliding window W (Gemma 3's local layers): t - W < p <= t;
- sinks S plus a window (StreamingLLM's cache policy, `--kv-window K --sink-tokens S`): the
  sliding rule with W = K + 1, plus the first S positions, always visible.

Each sequence holds one block table per group. A block of a windowed group that holds no
position a later query can see is handed back after each step (its table entry becomes
RELEASED); a full group's blocks stay until the sequence ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor

RELEASED = -1  # a block table entry whose block was handed back (out of every future query's window)


@dataclass(frozen=True)
class KVGroup:
    """Layers `layers` of one kind: full attention (window None) or a window W with S sinks."""

    layers: tuple[int, ...]
    window: Optional[int] = None
    sinks: int = 0

    @property
    def windowed(self) -> bool:
        return self.window is not None

    def first_visible(self, query_position: int) -> int:
        """The oldest non-sink position a query at `query_position` sees."""
        return 0 if self.window is None else max(0, query_position - self.window + 1)

    def visible(self, queries: Tensor, held: Tensor) -> Tensor:
        """[queries, held] mask: which held positions each query position sees."""
        seen = held[None, :] <= queries[:, None]
        if self.window is not None:
            seen &= (held[None, :] > queries[:, None] - self.window) | (held[None, :] < self.sinks)
        return seen

    def releasable(self, block: int, block_size: int, next_position: int) -> bool:
        """Whether block `block` of a table holds nothing a query at `next_position` or later sees."""
        if self.window is None:
            return False
        first, last = block * block_size, (block + 1) * block_size - 1
        return first >= self.sinks and last < self.first_visible(next_position)

    def peak_blocks(self, tokens: int, chunk: int, block_size: int) -> int:
        """Blocks a sequence of `tokens` tokens can hold at once in this group when a step feeds at
        most `chunk` tokens: every block in a full group; a windowed group's sinks, window and chunk."""
        need = -(-tokens // block_size)
        if self.window is None:
            return need
        return min(need, -(-self.sinks // block_size) + -(-(self.window - 1 + chunk) // block_size) + 1)

    def needed_blocks(self, next_position: int, block_size: int) -> range:
        """Logical blocks (besides the sinks' blocks) a query at `next_position` may read."""
        return range(self.first_visible(next_position) // block_size, -(-next_position // block_size))


FULL = KVGroup(layers=())  # a stand-in for "one full-attention group" where the layers do not matter


def model_groups(layer_windows: Sequence[Optional[int]], groups_of_layers: Sequence[Sequence[int]],
                 kv_window: Optional[int] = None, sink_tokens: int = 0) -> list[KVGroup]:
    """Groups for a model whose layer i has window layer_windows[i] (None: full attention), laid
    out as `groups_of_layers` (the plan's grouping), under an optional sinks + window policy.

    Under the policy a full layer sees its sinks and the newest kv_window + 1 positions; a
    sliding layer keeps its own window where it is the narrower (sinks then do not apply).
    """
    groups = []
    for members in groups_of_layers:
        windows = {layer_windows[i] for i in members}
        if len(windows) != 1:
            raise ValueError(f"layers {list(members)} of one group have different windows {sorted(map(str, windows))}")
        window = windows.pop()
        sinks = 0
        if kv_window is not None and (window is None or kv_window + 1 < window):
            window, sinks = kv_window + 1, sink_tokens
        groups.append(KVGroup(tuple(members), window, sinks))
    return groups
