"""One replica as the engine runs it: kvlab.engine's own Scheduler and BlockManager, on a virtual clock.

Each step is exactly the engine's (kvlab.engine.engine.LLMEngine.step) with the model replaced
by a price: the scheduler picks the sequences and their token counts at virtual time `now`,
the step costs `cost.seconds(shape)`, and at its end every sequence advances by what it was fed
(the runner's num_computed update), full blocks are named for the prefix cache
(commit_full_blocks), and a sequence that reached its last token emits one token and finishes
at its max_tokens (requests run with ignore_eos, as `kvlab bench serve --ignore-eos`).
Token ids stand for content: a shared prefix is the same ids for every request of its group,
everything else is unique, so the block manager's chained hashes find exactly the sharing the
workload describes. This is the reference the fast path (replica_fast) is tested against.
"""

from __future__ import annotations

from typing import Optional

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.errors import RequestError
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import Scheduler, SchedulerConfig, draft_budget
from kvlab.engine.sequence import Sequence
from kvlab.fleet.outcomes import Outcomes
from kvlab.fleet.service import ReplicaSpec
from kvlab.fleet.speculation import SpecStep
from kvlab.fleet.step_cost import chunk_pairs
from kvlab.fleet.workload import Requests

UNIQUE_STRIDE = 1 << 24  # token positions per request in the id space of unique tokens


def prompt_ids(requests: Requests, i: int) -> list[int]:
    """Content-standing ids: the group's prefix (shared), then ids no other request has."""
    n, p, g = int(requests.prompt_len[i]), int(requests.prefix_len[i]), int(requests.prefix_id[i])
    head = [((g + 1) << 40) + k for k in range(p)] if g >= 0 else []
    return head + [-(i * UNIQUE_STRIDE + k + 1) for k in range(p, n)]


class EngineReplica:
    def __init__(self, spec: ReplicaSpec, requests: Requests, out: Outcomes, replica_id: int = 0,
                 sample_every: Optional[float] = None, max_wait_ms: float = 0.0) -> None:
        self.spec, self.requests, self.out, self.replica_id = spec, requests, out, replica_id
        self.blocks = BlockManager(spec.num_blocks, spec.block_size, spec.enable_prefix_caching)
        lookahead = spec.speculation.num_speculative_tokens if spec.speculation else 0
        self.scheduler = Scheduler(SchedulerConfig(spec.max_num_seqs, spec.max_num_batched_tokens,
                                                   spec.max_model_len, max_wait_ms, lookahead), self.blocks)
        self.now = 0.0
        self.sample_every, self.next_sample = sample_every, 0.0
        self.peak_blocks_used = 0

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def add(self, i: int, t: float) -> None:
        if not self.scheduler.has_work:
            self.now = max(self.now, t)
        seq = Sequence(str(i), prompt_ids(self.requests, i),
                       SamplingParams(max_tokens=int(self.requests.output_len[i]), ignore_eos=True), t)
        seq.fleet_index = i
        self.out.replica[i] = self.replica_id
        try:
            self.scheduler.add(seq)
        except RequestError:
            self.out.rejected[i] = True

    def advance_until(self, t: float) -> None:
        """Run every step that starts before `t` (requests arriving at `t` join the step after)."""
        while self.now < t and self.scheduler.has_work:
            if not self.step(limit=t):
                break
        if not self.scheduler.has_work:
            self.now = max(self.now, t)

    def drain(self) -> None:
        while self.scheduler.has_work:
            if not self.step():
                raise RuntimeError("the scheduler holds work it cannot schedule")  # a bug, never a user mistake

    def step(self, limit: float = float("inf")) -> bool:
        scheduler, blocks, out = self.scheduler, self.blocks, self.out
        scheduled = scheduler.schedule(self.now)
        if not scheduled:
            deadline = scheduler.next_deadline()
            if deadline is not None and deadline > self.now:
                self.now = min(deadline, limit)
                return True
            return False
        if self.spec.speculation is not None:
            end = self._speculative_step(scheduled)
        else:
            end = self._plain_step(scheduled)
        out.steps += 1
        if self.sample_every is not None and self.now >= self.next_sample:
            out.timeline.append((self.now, self.replica_id, blocks.usage, len(scheduler.running),
                                 len(scheduler.waiting), scheduler.num_preemptions))
            self.next_sample = self.now + self.sample_every
        self.now = end
        return True

    def _finish_at_length(self, seq: Sequence, end: float) -> None:
        i = seq.fleet_index
        if len(seq.output_ids) >= seq.params.max_tokens:
            self.scheduler.finish(seq, "length")
            out = self.out
            out.first_token[i], out.finish[i] = seq.first_token_time, end
            out.preemptions[i], out.cached_tokens[i] = seq.preemptions, seq.num_cached_prompt

    def _speculative_step(self, scheduled) -> float:
        """The engine's speculative step (runner.run and _verify, then commit_full_blocks and trim), priced."""
        blocks, spec, out = self.blocks, self.spec, self.out
        speculation = spec.speculation
        shape = SpecStep()
        drafts = []
        for seq, n in zip(scheduled.seqs, scheduled.num_tokens):
            d = 0
            if n == 1 and seq.remaining == 1:  # a decode (the runner's rule): it drafts within its slots
                d = draft_budget(speculation.num_speculative_tokens, seq.params.max_tokens, len(seq.output_ids),
                                 spec.max_model_len, seq.num_tokens,
                                 len(seq.block_table) * blocks.block_size - seq.num_tokens)
                if d:
                    shape.verify(seq.num_computed, d)
                else:
                    shape.decode(seq.num_computed)
            else:
                shape.chunk(seq.num_computed, n)
            drafts.append(d)
        self.peak_blocks_used = max(self.peak_blocks_used, blocks.num_blocks - blocks.num_free)
        end = self.now + shape.seconds(spec.cost, speculation.draft_cost)
        for seq, n, d in zip(scheduled.seqs, scheduled.num_tokens, drafts):
            if d:
                accepted = min(d, speculation.accepted_run(seq.fleet_index, len(seq.output_ids)))
                out.num_drafts += 1
                out.num_draft_tokens += d
                out.num_accepted_tokens += accepted
                seq.num_computed += 1 + accepted  # the last token and the accepted drafts hold valid K/V
                emitted = accepted + 1
            else:
                seq.num_computed += n
                emitted = 1 if seq.num_computed == seq.num_tokens else 0
            for _ in range(emitted):  # content no one else has
                seq.output_ids.append(-(seq.fleet_index * UNIQUE_STRIDE + seq.num_tokens + 1))
            if emitted and seq.first_token_time is None:
                seq.first_token_time = end
            blocks.commit_full_blocks(seq)  # with the emitted ids in place, so full blocks are named by them
            blocks.trim(seq)  # the rejected drafts' slots go back
            self._finish_at_length(seq, end)
        return end

    def _plain_step(self, scheduled) -> float:
        scheduler, blocks, out = self.scheduler, self.blocks, self.out
        decode_seqs = decode_ctx = prefill_tokens = prefill_pairs = prefill_kv = 0
        for seq, n in zip(scheduled.seqs, scheduled.num_tokens):
            if n == 1 and seq.remaining == 1:
                decode_seqs += 1
                decode_ctx += seq.num_computed
            else:
                prefill_tokens += n
                prefill_pairs += chunk_pairs(seq.num_computed, n)
                prefill_kv += seq.num_computed + n
        self.peak_blocks_used = max(self.peak_blocks_used, blocks.num_blocks - blocks.num_free)
        end = self.now + self.spec.cost.seconds(decode_seqs, decode_ctx, prefill_tokens, prefill_pairs, prefill_kv)
        for seq, n in zip(scheduled.seqs, scheduled.num_tokens):
            seq.num_computed += n
            blocks.commit_full_blocks(seq)
            if seq.num_computed == seq.num_tokens:
                i = seq.fleet_index
                seq.output_ids.append(-(i * UNIQUE_STRIDE + seq.num_tokens + 1))
                if seq.first_token_time is None:
                    seq.first_token_time = end
                if len(seq.output_ids) >= seq.params.max_tokens:
                    scheduler.finish(seq, "length")
                    out.first_token[i], out.finish[i] = seq.first_token_time, end
                    out.preemptions[i], out.cached_tokens[i] = seq.preemptions, seq.num_cached_prompt
        return end
