"""Who runs this step and how many tokens each feeds: continuous batching with chunked prefill.

The policy is vLLM V1's, decode-first chunked prefill:
1. Running sequences go first, oldest first: a decoding one feeds 1 token, one still reading
   its prompt feeds the next chunk, all within `max_num_batched_tokens`. A sequence that
   cannot get a block preempts the newest running sequence (recompute: its blocks are freed
   and it goes back to the front of the queue), as vLLM does; so a long prompt never stalls
   everyone's decode, and nothing fails for lack of blocks if it fits alone.
2. Waiting sequences are admitted, oldest first, while seats (`max_num_seqs`), tokens and
   blocks last; the last one admitted may take only a chunk of its prompt.
New requests join between steps and finished ones leave at once. With `max_wait_ms` > 0
(the seeds' batching rule), waiting requests are held until the batch would be full or the
oldest has waited that long, whichever comes first; 0 (the default) admits at once.

The scheduler never reads a clock: every call takes `now` (seconds), so the fleet simulator
can drive this same class with a virtual clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.errors import RequestError
from kvlab.engine.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_wait_ms: float = 0.0
    lookahead: int = 0  # slots reserved past each decode for speculative drafts (k)


def draft_budget(k: int, max_tokens: int | None, outputs: int, max_model_len: int, num_tokens: int,
                 slots: int) -> int:
    """Drafts a decoding sequence may take: k, within max_tokens (the target adds one token of its own),
    the model length, and the `slots` its block table holds past its tokens (the lookahead reserved)."""
    left = (max_tokens or k + 1) - outputs - 1
    return max(0, min(k, left, max_model_len - num_tokens - 1, slots))


@dataclass
class ScheduledStep:
    """The sequences of one step, in order, and the tokens each feeds."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config, self.blocks = config, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def check_fits(self, seq: Sequence) -> None:
        """Refuse at admission what could never run: over the model length or over the whole pool."""
        limit = self.config.max_model_len
        wanted = len(seq.prompt_ids) + (seq.params.max_tokens or 1)
        if len(seq.prompt_ids) >= limit or (seq.params.max_tokens is not None and wanted > limit):
            raise RequestError(f"this model's maximum context length is {limit} tokens; the request asks for "
                               f"{len(seq.prompt_ids)} prompt + {seq.params.max_tokens} new tokens", "max_tokens")
        # windowed groups hand blocks back: at most their sinks, window and a chunk held
        need = self.blocks.peak_blocks(min(wanted, limit), self.config.max_num_batched_tokens)
        if need > self.blocks.num_blocks:
            raise RequestError(f"the request needs {need} KV blocks and the whole pool has {self.blocks.num_blocks}; "
                               "lower max_tokens or raise --kv-cache-memory", "max_tokens")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_deadline(self) -> Optional[float]:
        """When held waiting requests must be admitted (the max-wait rule), or None."""
        if not self.waiting or self.config.max_wait_ms <= 0:
            return None
        return self.waiting[0].arrival + self.config.max_wait_ms / 1000

    def _admission_open(self, now: float) -> bool:
        if self.config.max_wait_ms <= 0 or not self.waiting:
            return True
        full = len(self.running) + len(self.waiting) >= self.config.max_num_seqs
        return full or now >= self.waiting[0].arrival + self.config.max_wait_ms / 1000

    def schedule(self, now: float) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:  # 1. running, oldest first
            seq = self.running[index]
            n = min(seq.remaining, budget)
            reserve = n
            if n == 1 and seq.remaining == 1 and self.config.lookahead:  # a decode: room for the drafts too
                reserve = max(1, min(1 + self.config.lookahead, budget, self.config.max_model_len - seq.num_computed))
            while not self.blocks.allocate_slots(seq, reserve):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: everything after it is gone too
            step.seqs.append(seq)
            step.num_tokens.append(n)
            budget -= reserve
            index += 1
        if not step.preempted and self._admission_open(now):  # 2. waiting, oldest first
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                n = self.blocks.admit(seq, budget)  # its cached prefix and its first chunk, or nothing
                if n is None:
                    break
                self.waiting.popleft()
                seq.status = Status.RUNNING
                if seq.first_scheduled is None:
                    seq.first_scheduled = now
                self.running.append(seq)
                step.seqs.append(seq)
                step.num_tokens.append(n)
                budget -= n
        return step

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        """Recompute preemption: free the newest sequence's blocks and queue it first."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues and give its blocks back (any state, any reason)."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
