"""The "medusa" proposer: drafts from a Medusa head set (kvlab.nn.medusa) on the target's last hidden state.

The runner records each sequence's final hidden states as for an EAGLE head
(kvlab.engine.eagle_proposer.record_features), keeping one: h at the position before the last
token, the state the target's LM head read to choose that token. Head j guesses the token j
places after it, so one batched pass over every drafting sequence's h gives all k drafts: no
rounds, no K/V, nothing in the pool.

Sampled requests draw each draft from head j's distribution over the draft vocabulary scattered
into the target's (zero outside it) with the request's temperature and filters. The heads do not
see each other's draws, but each q_j is still the distribution the draft was drawn from, which is
all the acceptance rule needs for the output to stay exactly the target's distribution.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvlab.engine.eagle_proposer import packed_head
from kvlab.engine.sampling import draw, filtered_logits
from kvlab.engine.sequence import Sequence
from kvlab.nn.medusa import MedusaHead


class MedusaProposer:
    window = 1  # hidden states each sequence keeps

    def __init__(self, head: MedusaHead) -> None:
        self.head = packed_head(head.eval(), ("lm_head",))  # the blocks carry biases; they are 1/8 of the bytes
        self.num_heads = head.config.num_heads

    @staticmethod
    def last_hidden(seq: Sequence) -> Optional[torch.Tensor]:
        """h at the position before the last token (the one that chose it), or None when not recorded."""
        held = seq.draft_features
        last = seq.num_tokens - 2
        if held is None or not held[0] <= last < held[0] + len(held[1]):
            return None
        return held[1][last - held[0]]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int], generator: torch.Generator):
        drafts: list[list[int]] = [[] for _ in seqs]
        q: list[Optional[torch.Tensor]] = [None] * len(seqs)
        rows = {i: self.last_hidden(seq) for i, (seq, budget) in enumerate(zip(seqs, budgets)) if budget}
        live = [i for i, h in rows.items() if h is not None]
        if not live:
            return drafts, q
        heads = min(self.num_heads, max(budgets[i] for i in live))
        logits = self.head(torch.stack([rows[i] for i in live]), heads)  # [n, heads, draft_vocab]
        for n, i in enumerate(live):
            seq, k = seqs[i], min(budgets[i], heads)
            if seq.params.greedy:
                drafts[i] = self.head.d2t[logits[n, :k].argmax(-1)].tolist()
                continue
            dists = torch.stack([torch.softmax(filtered_logits(self.head.full_logits(row), seq.params), dim=-1)
                                 for row in logits[n, :k]])
            drafts[i] = draw(dists, seq.generator or generator)
            q[i] = dists
        return drafts, q
