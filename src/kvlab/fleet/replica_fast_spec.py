"""The fast replica with speculative decoding: decoders visited one by one, the rest as replica_fast.

With a draft, every decoder advances by its own random number of tokens each step, so the
fast path's trick (all decoders advance together, counted in phase buckets) does not apply.
This replica keeps replica_fast's block bookkeeping (shared-prefix groups, the LRU model, the
preempted sequences' own blocks) and admission, and takes every step the way the engine's
Scheduler.schedule does with `lookahead` = k: running sequences oldest first, a decode
reserving 1 + k slots (within the token budget and the model length), preemption of the
newest when the pool is short; then the runner's rule for the drafts each decode may take
(kvlab.engine.scheduler.draft_budget), the accepted runs (kvlab.fleet.speculation), and the
engine's trim of the rejected drafts' blocks. Its cost is Python per running sequence per
step: slower than the plain fast path, still far faster than the engine path's token lists.
"""

from __future__ import annotations

from kvlab.engine.scheduler import draft_budget
from kvlab.fleet.replica_fast import FastReplica, _Seq
from kvlab.fleet.speculation import SpecStep


class SpeculativeFastReplica(FastReplica):
    def step(self) -> None:
        spec, bs = self.spec, self.bs
        speculation = spec.speculation
        k = speculation.num_speculative_tokens
        budget = spec.max_num_batched_tokens
        running = self.running
        chunks: list[tuple[_Seq, int]] = []
        preempted = False
        index = 0
        while index < len(running) and budget > 0:  # Scheduler.schedule's first loop, with the lookahead
            s = running[index]
            left = s.tokens - s.computed
            n = min(left, budget)
            reserve = n
            if n == 1 and left == 1:
                reserve = max(1, min(1 + k, budget, spec.max_model_len - s.computed))
            while -(-(s.computed + reserve) // bs) - s.held > self.free:
                victim = running[-1]
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            if index >= len(running) or running[index] is not s:
                break  # it preempted itself: everything after it is gone too
            self._grow(s, s.computed + reserve)
            chunks.append((s, n))
            budget -= reserve
            index += 1
        if not preempted:
            self._admit(budget, chunks)
        self.prefilling = []  # replica_fast's list of prompt readers: unused here
        shape = SpecStep()
        drafts = []
        for s, n in chunks:
            d = 0
            if n == 1 and s.tokens - s.computed == 1:
                d = draft_budget(k, s.target, s.outputs, spec.max_model_len, s.tokens, s.held * bs - s.tokens)
                if d:
                    shape.verify(s.computed, d)
                else:
                    shape.decode(s.computed)
            else:
                shape.chunk(s.computed, n)
            drafts.append(d)
        used = spec.num_blocks - self.free
        if used > self.peak_blocks_used:
            self.peak_blocks_used = used
        end = self.now + shape.seconds(spec.cost, speculation.draft_cost)
        out = self.out
        for (s, n), d in zip(chunks, drafts):
            if d:
                accepted = min(d, speculation.accepted_run(s.i, s.outputs))
                out.num_drafts += 1
                out.num_draft_tokens += d
                out.num_accepted_tokens += accepted
                s.computed += 1 + accepted
                s.outputs += accepted + 1
            else:
                s.computed += n
                if s.computed == s.tokens:
                    s.outputs += 1
            if s.first is None and s.outputs:  # a prompt's last token (a 1-token chunk drafts too, as the runner)
                s.first = end
            self._commit(s)
            keep = -(-s.computed // bs)  # BlockManager.trim
            if s.held > keep:
                self.free += s.held - keep
                s.held = keep
            if s.outputs >= s.target:
                running.remove(s)
                self._release(s)
                self._record(s, end)
        out.steps += 1
        if self.sample_every is not None and self.now >= self.next_sample:
            out.timeline.append((self.now, self.replica_id, used / spec.num_blocks, len(running),
                                      len(self.waiting), self.num_preemptions))
            self.next_sample = self.now + self.sample_every
        self.now = end
        self.D += 1
