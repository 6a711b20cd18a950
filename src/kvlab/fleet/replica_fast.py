"""The engine's scheduling policy with per-step cost independent of the batch size, for days of traffic.

Same rules as kvlab.engine.scheduler (decode-first chunked prefill, oldest first, recompute
preemption of the newest, admission while seats, tokens and blocks last) and the same block
arithmetic as kvlab.engine.block_manager, but decoding sequences are counted, not visited:
- all decoders advance together, so a decoder's context is c0 + (D - base) for the step counter
  D; the blocks they need this step are the decoders whose context is a multiple of block_size,
  kept in block_size phase buckets; their total context is a running sum;
- finishes come off a heap keyed by the step on which the last token is due;
- only sequences still reading their prompt (a few) are visited each step.
When the token budget or the pool would bind for running sequences, the step is taken the slow
way, sequence by sequence in the engine's order (with the engine's preemption), so what the
scheduler would do is still what happens. The prefix cache is modelled per shared-prefix group
(blocks named as prompts are computed, shared with reference counts, freed to the back of an
LRU queue and evicted when that many fresh blocks were taken since); a preempted sequence's
own blocks are found again on the same rule. Two approximations, both tested against the engine
path: evictions ignore cached blocks taken out of the middle of the free queue, and a group's
blocks are only evicted once no running sequence holds any of them.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Optional

import numpy as np

from kvlab.fleet.outcomes import Outcomes
from kvlab.fleet.service import ReplicaSpec
from kvlab.fleet.step_cost import chunk_pairs
from kvlab.fleet.workload import Requests


class _Seq:
    __slots__ = ("i", "prompt", "target", "outputs", "computed", "held", "group", "shared", "decoding", "c0",
                 "base", "version", "preemptions", "first", "cached", "own")

    def __init__(self, i: int, prompt: int, target: int, group: int) -> None:
        self.i, self.prompt, self.target, self.group = i, prompt, target, group
        self.outputs = self.computed = self.held = self.shared = self.c0 = self.base = 0
        self.decoding = False
        self.version = self.preemptions = self.cached = 0
        self.first: Optional[float] = None
        self.own: Optional[tuple[int, int, int, int]] = None  # (start block, named blocks, taken at free, ahead)

    @property
    def tokens(self) -> int:
        return self.prompt + self.outputs


class _Group:
    __slots__ = ("blocks", "named", "refs", "holders", "freed")

    def __init__(self, blocks: int) -> None:
        self.blocks, self.named, self.holders = blocks, 0, 0
        self.refs = np.zeros(max(blocks, 1), dtype=np.int64)
        self.freed: Optional[tuple[int, int]] = None  # (taken at free, ahead) once nobody holds any block


class FastReplica:
    def __init__(self, spec: ReplicaSpec, requests: Requests, out: Outcomes, replica_id: int = 0,
                 sample_every: Optional[float] = None) -> None:
        if spec.max_num_seqs > spec.max_num_batched_tokens:
            raise ValueError("the fast path needs max_num_seqs <= max_num_batched_tokens")
        self.spec, self.requests, self.out, self.replica_id = spec, requests, out, replica_id
        self.bs = spec.block_size
        self.free = spec.num_blocks
        self.taken = 0  # fresh blocks taken from the front of the free queue, ever
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []  # admission order, oldest first
        self.prefilling: list[_Seq] = []  # running and still reading their prompt, in running order
        self.nd = 0  # decoders
        self.ksum = 0  # sum over decoders of c0 - base
        self.buckets = [0] * self.bs  # decoders by (base - c0) % bs
        self.finishes: list[tuple[int, int, int, _Seq]] = []
        self.D = 0
        self.now = 0.0
        self.groups: dict[int, _Group] = {}
        self.num_preemptions = 0
        self.sample_every, self.next_sample = sample_every, 0.0
        self.peak_blocks_used = 0
        self._tie = 0

    # -- requests ------------------------------------------------------------------------------------

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, i: int, t: float) -> None:
        r, spec = self.requests, self.spec
        prompt, target = int(r.prompt_len[i]), int(r.output_len[i])
        self.out.replica[i] = self.replica_id
        wanted = prompt + target
        if prompt >= spec.max_model_len or wanted > spec.max_model_len or \
                -(-min(wanted, spec.max_model_len) // self.bs) > spec.num_blocks:
            self.out.rejected[i] = True  # the engine's Scheduler.check_fits
            return
        if not self.has_work:
            self.now = max(self.now, t)
        group = int(r.prefix_id[i]) if spec.enable_prefix_caching else -1
        if group >= 0 and group not in self.groups:
            self.groups[group] = _Group(int(r.prefix_len[i]) // self.bs)
        self.waiting.append(_Seq(i, prompt, target, group))

    def advance_until(self, t: float) -> None:
        while self.now < t and self.has_work:
            self.step()
        if not self.has_work:
            self.now = max(self.now, t)

    def drain(self) -> None:
        while self.has_work:
            self.step()

    # -- block bookkeeping ---------------------------------------------------------------------------

    def _group_blocks(self, g: _Group) -> int:
        """The group's named blocks still cached (evicting those the LRU queue has reached)."""
        if g.holders == 0 and g.freed is not None and g.named:
            taken_at, ahead = g.freed
            survive = min(g.named, max(0, ahead + g.named - (self.taken - taken_at)))
            if survive < g.named:
                g.named = survive
        return g.named

    def _cached(self, s: _Seq) -> tuple[int, int, int]:
        """(cached blocks, of which group blocks, reusable free blocks among them): _cached_prefix."""
        if not self.spec.enable_prefix_caching:
            return 0, 0, 0
        limit = (s.tokens - 1) // self.bs
        group_part, free_part = 0, 0
        if s.group >= 0:
            g = self.groups[s.group]
            group_part = min(self._group_blocks(g), limit)
            if group_part:
                free_part = int(np.count_nonzero(g.refs[:group_part] == 0))
        own_part = 0
        if s.own is not None:
            start, named, taken_at, ahead = s.own
            if group_part >= start:
                survive = min(named, max(0, ahead + named - (self.taken - taken_at)))
                own_part = max(0, min(start + survive, limit) - group_part)
        return group_part + own_part, group_part, free_part + own_part

    def _release(self, s: _Seq) -> None:
        """BlockManager.free: private blocks (tail first) then the shared prefix blocks, to the queue's back."""
        private = s.held - s.shared
        ahead = self.free
        self.free += private
        if s.shared:
            g = self.groups[s.group]
            refs = g.refs[:s.shared]
            refs -= 1
            self.free += int(np.count_nonzero(refs == 0))
            g.holders -= 1
            if g.holders == 0:
                g.freed = (self.taken, ahead + private)
        named = s.computed // self.bs - s.shared  # its own named blocks lead the private ones: freed last of them
        s.own = (s.shared, named, self.taken, ahead + private - named) if named > 0 else None
        s.held = s.shared = 0

    def _grow(self, s: _Seq, tokens: int) -> None:
        need = -(-tokens // self.bs) - s.held
        if need > 0:
            self.free -= need
            self.taken += need
            s.held += need

    def _commit(self, s: _Seq) -> None:
        """commit_full_blocks for the shared prefix: extend the group's named chain with this sequence's blocks."""
        if s.group < 0:
            return
        g = self.groups[s.group]
        full = min(s.computed // self.bs, g.blocks)
        while s.shared == g.named and g.named < full:
            if s.shared == 0:
                g.holders += 1
                g.freed = None
            g.refs[g.named] += 1
            g.named += 1
            s.shared += 1

    # -- decoders as counts --------------------------------------------------------------------------

    def _to_decoder(self, s: _Seq) -> None:
        s.decoding, s.c0, s.base = True, s.computed, self.D + 1
        self.nd += 1
        self.ksum += s.c0 - s.base
        self.buckets[(s.base - s.c0) % self.bs] += 1
        s.version += 1
        heapq.heappush(self.finishes, (s.base + s.target - s.outputs - 1, self._tie, s.version, s))
        self._tie += 1

    def _sync(self, s: _Seq, steps_done: int) -> None:
        """A decoder's counters as of `steps_done` steps (its context, outputs, blocks held)."""
        advanced = steps_done - s.base
        s.computed = s.c0 + advanced
        s.outputs += advanced
        s.held = -(-s.computed // self.bs)
        s.c0, s.base = s.computed, steps_done

    def _drop_decoder(self, s: _Seq) -> None:
        self.nd -= 1
        self.ksum -= s.c0 - s.base
        self.buckets[(s.base - s.c0) % self.bs] -= 1
        s.decoding = False
        s.version += 1

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> None:
        spec, bs, D = self.spec, self.bs, self.D
        budget = spec.max_num_batched_tokens
        new_decode_blocks = self.buckets[D % bs]
        chunks: list[tuple[_Seq, int]] = []
        want_tokens, want_blocks = self.nd, new_decode_blocks
        for s in self.prefilling:
            n = s.tokens - s.computed
            chunks.append((s, n))
            want_tokens += n
            want_blocks += max(0, -(-(s.computed + n) // bs) - s.held)
        preempted = False
        skipped: list[_Seq] = []
        slow = not (want_tokens <= budget and want_blocks <= self.free)
        if not slow:
            for s, n in chunks:  # the common case: everyone running gets what it wants
                self._grow(s, s.computed + n)
            self.free -= new_decode_blocks
            self.taken += new_decode_blocks
            budget -= want_tokens
            decode_seqs, decode_ctx = self.nd, self.ksum + self.nd * D
        else:
            chunks, decode_seqs, decode_ctx, budget, preempted, skipped = self._slow_running(budget)
        if not preempted:
            budget = self._admit(budget, chunks)
        prefill_tokens = prefill_pairs = prefill_kv = 0
        for s, n in chunks:
            if n == 1 and s.tokens - s.computed == 1:
                decode_seqs += 1
                decode_ctx += s.computed
            else:
                prefill_tokens += n
                prefill_pairs += chunk_pairs(s.computed, n)
                prefill_kv += s.computed + n
        used = spec.num_blocks - self.free
        if used > self.peak_blocks_used:
            self.peak_blocks_used = used
        end = self.now + spec.cost.seconds(decode_seqs, decode_ctx, prefill_tokens, prefill_pairs, prefill_kv)
        out = self.out
        finishes = self.finishes
        for s in skipped:  # running decoders the budget left out this step: they wait one step
            self._drop_decoder(s)
            s.base += 1
            self.nd += 1
            self.ksum += s.c0 - s.base
            self.buckets[(s.base - s.c0) % self.bs] += 1
            s.decoding = True
            s.version += 1
            heapq.heappush(finishes, (s.base + s.target - s.outputs - 1, self._tie, s.version, s))
            self._tie += 1
        while finishes and finishes[0][0] <= D:  # decoders whose last token comes this step
            _, _, version, s = heapq.heappop(finishes)
            if version != s.version:
                continue
            self._sync(s, D + 1)
            self._drop_decoder(s)
            self.running.remove(s)
            self._release(s)
            self._record(s, end)
        still = []
        for s, n in chunks:
            s.computed += n
            self._commit(s)
            if s.computed == s.tokens:
                s.outputs += 1
                if s.first is None:
                    s.first = end
                if s.outputs >= s.target:
                    self.running.remove(s)
                    self._release(s)
                    self._record(s, end)
                else:
                    self._to_decoder(s)
            else:
                still.append(s)
        self.prefilling = still if not slow else [s for s in self.running if not s.decoding]
        out.steps += 1
        if self.sample_every is not None and self.now >= self.next_sample:
            out.timeline.append((self.now, self.replica_id, used / spec.num_blocks, len(self.running),
                                 len(self.waiting), self.num_preemptions))
            self.next_sample = self.now + self.sample_every
        self.now = end
        self.D = D + 1

    def _record(self, s: _Seq, end: float) -> None:
        out, i = self.out, s.i
        out.first_token[i], out.finish[i] = s.first, end
        out.preemptions[i], out.cached_tokens[i] = s.preemptions, s.cached

    def _slow_running(self, budget: int):
        """Scheduler.schedule's first loop, sequence by sequence: budget, blocks, preemption of the newest."""
        D, bs = self.D, self.bs
        chunks: list[tuple[_Seq, int]] = []
        decode_seqs = decode_ctx = 0
        preempted = False
        index = 0
        running = self.running
        for s in running:
            if s.decoding:
                self._sync(s, D)
        while index < len(running) and budget > 0:
            s = running[index]
            n = min(s.tokens - s.computed, budget)
            while -(-(s.computed + n) // bs) - s.held > self.free:
                victim = running[-1]
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            if s not in running or running[index] is not s:
                break
            self._grow(s, s.computed + n)
            if s.decoding:
                decode_seqs += 1
                decode_ctx += s.computed
            else:
                chunks.append((s, n))
            budget -= n
            index += 1
        skipped = [s for s in running[index:] if s.decoding]
        self.prefilling = [s for s in self.prefilling if s in running]
        return chunks, decode_seqs, decode_ctx, budget, preempted, skipped

    def _preempt(self, s: _Seq) -> None:
        self.running.remove(s)
        if s.decoding:
            self._drop_decoder(s)
        else:
            self.prefilling = [p for p in self.prefilling if p is not s]
        self._release(s)
        s.computed = 0
        s.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(s)

    def _admit(self, budget: int, chunks: list[tuple[_Seq, int]]) -> int:
        spec, bs = self.spec, self.bs
        while self.waiting and budget > 0 and len(self.running) < spec.max_num_seqs:
            s = self.waiting[0]
            cached_blocks, group_part, reusable = self._cached(s)
            n = min(s.tokens - cached_blocks * bs, budget)
            need = max(0, -(-(cached_blocks * bs + n) // bs) - cached_blocks)
            if need > self.free - reusable:
                break
            self.waiting.popleft()
            if group_part:
                g = self.groups[s.group]
                refs = g.refs[:group_part]
                self.free -= int(np.count_nonzero(refs == 0))
                refs += 1
                g.holders += 1
                g.freed = None
            self.free -= cached_blocks - group_part
            s.shared, s.held = group_part, cached_blocks
            s.computed = cached_blocks * bs
            s.cached = min(s.computed, s.prompt)
            s.own = None
            self._grow(s, s.computed + n)
            self.running.append(s)
            self.prefilling.append(s)
            chunks.append((s, n))
            budget -= n
        return budget
