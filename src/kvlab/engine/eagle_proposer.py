"""The "eagle" proposer: drafts from an EAGLE head (kvlab.nn.eagle) on the target's own hidden states.

Every target step of a speculating engine hands back each fed row's final hidden state
(the C step's `hidden`, the module path's `with_hidden`); the runner records, per sequence,
those of the positions whose K/V stay valid (a verification's last token and accepted drafts,
a prompt chunk's every row), keeping the last `window` (Sequence.draft_features). A draft round
runs the head over that window: inputs (embedding of x_{i+1}, h_i) for the recorded positions
i, then (embedding of the drafted token, the head's own feature) for each earlier round, the
band of `window` rows the head's attention sees. No K/V of its own, so nothing in the pool: a
round computes one position's layer (EagleHead.last) over the keys and values of the band, and
each position's own inputs (EagleHead.inputs) once, kept per sequence between rounds.

Sampled requests draw from the head's distribution over its draft vocabulary scattered into the
target's (zero outside it), with the request's temperature and filters; that is the q the
acceptance rule divides by, so the output distribution stays exactly the target's.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvlab.engine.sampling import draw, filtered_logits
from kvlab.engine.sequence import Sequence
from kvlab.nn.eagle import EagleHead
from kvlab.nn.c_model import embed_rows


def record_features(seq: Sequence, start: int, rows: torch.Tensor, window: int) -> None:
    """Hidden states of positions start.. (rows [n, dim]) into the sequence's window; a rerun or a
    rollback overwrites what it recorded past `start`."""
    held = seq.draft_features
    if held is not None and held[0] <= start <= held[0] + len(held[1]):
        rows = torch.cat((held[1][:start - held[0]], rows))
        start = held[0]
    drop = max(0, len(rows) - window)
    seq.draft_features = (start + drop, rows[drop:].float().clone())


def packed_head(head, names=("fc", "qkv", "o", "gate_up", "down", "lm_head")):
    """A copy whose matrices `names` (bias-free linears) are Q8_0 (kvlab.nn.pack) where the C kernels exist: a
    draft round reads about a quarter of the bytes (the 8,192-row LM head alone is 19 MB in fp32), and decode at
    batch 1 is bound by them. Drafts only propose, so rounding the head changes acceptance, never the output."""
    import copy

    from kvlab.nn.ggml import QK, GGMLLinear
    from kvlab.nn.kernels import kernels
    from kvlab.nn.pack import q8_0_planes
    if kernels() is None:
        return head
    packed = copy.deepcopy(head)
    for name in names:
        layer = getattr(packed, name)
        if layer.in_features % QK == 0:
            setattr(packed, name, GGMLLinear(q8_0_planes(layer.weight)))
    return packed.eval()


class EagleProposer:
    def __init__(self, head: EagleHead, target) -> None:
        self.head, self.target = packed_head(head.eval()), target
        self.window = head.config.window

    def context(self, seq: Sequence) -> Optional[tuple[int, torch.Tensor, torch.Tensor]]:
        """(first position, ids of x_{i+1} [n], h_i [n, dim]) for the recorded positions i up to the last
        computed one, or None."""
        held = seq.draft_features
        last = seq.num_tokens - 2  # the position before the last token: its h and the last token start the chain
        if held is None or last < held[0] or last >= held[0] + len(held[1]):
            return None
        first, rows = held
        hidden = rows[:last - first + 1][-self.window:]
        begin = last + 1 - len(hidden)
        return begin, torch.tensor(seq.all_ids[begin + 1:last + 2]), hidden

    def inputs(self, seq: Sequence, begin: int, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The head's per-position inputs (EagleHead.inputs) for positions begin.., reusing those this
        sequence's previous round computed for the same positions with the same token and hidden state (a
        rollback or a recompute changes them, and then they are computed again): a round computes only the
        positions recorded since, about one row where the window holds four."""
        reuse, kept = 0, seq.draft_inputs
        if kept is not None and 0 <= begin - kept[0] < len(kept[1]):
            off = begin - kept[0]
            m = min(len(kept[1]) - off, len(ids))
            if torch.equal(kept[1][off:off + m], ids[:m]) and torch.equal(kept[2][off:off + m], hidden[:m]):
                reuse = m
        parts = []
        if reuse:
            x, q, k, v = kept[3:]
            parts.append((x[:, off:off + reuse], q[:, :, off:off + reuse], k[:, :, off:off + reuse],
                          v[:, :, off:off + reuse]))
        if reuse < len(ids):
            parts.append(self.head.inputs(embed_rows(self.target, ids[reuse:])[None], hidden[None, reuse:]))
        x, q, k, v = (torch.cat(t, dim=d) for t, d in zip(zip(*parts), (1, 2, 2, 2)))
        seq.draft_inputs = (begin, ids, hidden.clone(), x, q, k, v)  # a copy: what these inputs were computed from
        return x, q, k, v

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int], generator: torch.Generator):
        drafts: list[list[int]] = [[] for _ in seqs]
        q: list[Optional[torch.Tensor]] = [None] * len(seqs)
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            start = self.context(seq) if budget else None
            if start is None:
                continue
            x, query, keys, values = self.inputs(seq, *start)
            dists = []
            for round_ in range(budget):
                features, logits = self.head.last(x[:, -1:], query[:, :, -1:], keys, values)
                row = logits[0, -1]
                if seq.params.greedy:
                    token, dist = int(self.head.d2t[row.argmax()]), None
                else:
                    dist = torch.softmax(filtered_logits(self.head.full_logits(row), seq.params), dim=-1)
                    token = draw(dist[None], seq.generator or generator)[0]
                drafts[i].append(token)
                dists.append(dist)
                if round_ + 1 < budget:  # the drafted token and the head's own feature: the next round's position
                    x, query, k, v = self.head.inputs(embed_rows(self.target, torch.tensor([token]))[None], features)
                    keys = torch.cat((keys, k), dim=2)[:, :, -self.window:]
                    values = torch.cat((values, v), dim=2)[:, :, -self.window:]
            q[i] = torch.stack(dists) if dists and dists[0] is not None else None
        return drafts, q
