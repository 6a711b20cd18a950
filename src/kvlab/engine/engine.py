"""The engine loop: requests in, token deltas out. `step()` = schedule, run, post-process, return.

The pool is sized once from a memory budget with kvlab.plan's bytes per block (the same
arithmetic as `kvlab plan --engine vllm`), and the engine logs vLLM's start-up lines for it.
Everything a request holds goes back to the pool when it finishes, is aborted or fails.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from kvlab.engine.build import build
from kvlab.engine.config import EngineConfig
from kvlab.engine.detokenizer import Detokenizer
from kvlab.engine.errors import RequestError
from kvlab.engine.logits_process import LogitsProcessor
from kvlab.engine.outputs import StepDelta
from kvlab.engine.parallel_sampling import HeldSiblings, add_samples
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import ScheduledStep
from kvlab.engine.sequence import Sequence as Seq
from kvlab.nn.matmul_backend import NEVER, backend, crossover, library_dtype
from kvlab.nn.threads import ThreadGovernor, step_kind

log = logging.getLogger("kvlab.engine")


@dataclass
class PlannedStep:
    """A scheduled step between `LLMEngine.begin_step` and `end_step`: its sequences and token counts,
    where each sequence started (to roll a failed step back) and the virtual time it was run at."""

    scheduled: ScheduledStep
    starts: list[tuple[int, int]]
    now: Optional[float]


class LLMEngine:
    def __init__(self, model, tokenizer, config: Optional[EngineConfig] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = config = config or EngineConfig()
        self.clock = clock
        mc = model.config
        parts = build(model, config)  # kvlab.engine.build: budget, refusals, pool, scheduler, step
        self.max_model_len, self.speculative, self.capacity = parts.max_model_len, parts.speculative, parts.capacity
        self.pool, self.blocks, self.scheduler = parts.pool, parts.blocks, parts.scheduler
        self.runner, self.decode_path = parts.runner, parts.decode_path
        self.threads = ThreadGovernor()  # all threads on a quiet machine, one when the cores are shared
        self.requests: dict[str, tuple[Seq, Detokenizer]] = {}
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.on_finish: list[Callable[[Seq], None]] = []
        # Issue 39's request extras: the runner asks this processor to change the sampled rows' logits
        # (penalties, logit_bias, min_tokens, grammar masks), and `n`'s siblings wait in `held`.
        self.logits_processor = LogitsProcessor(tokenizer, mc.vocab_size)
        self.runner.logits_processor = self.logits_processor
        self.on_finish.append(self.logits_processor.forget)
        self.held = HeldSiblings()
        for line in self.capacity["log_lines"]:
            log.info(line)
        log.info(self.products_line)
        if self.runner.hybrid_from() is not None:  # the library copies now, not inside the first large step
            self.runner.hybrid_step.warm()

    @property
    def products_line(self) -> str:
        """Where this engine's products run (kvlab.nn.matmul_backend): logged at start-up, and in provenance."""
        probe = self.runner.probe_layer()
        if probe is None:
            return "products: torch on the model's own weights (no GGUF blocks)"
        setting = backend()
        if setting != "auto":
            return f"products: --matmul-backend {setting}" + self._hybrid_note
        rows = crossover(probe)  # measured here the first time on this machine, then remembered
        where = "never" if rows >= NEVER else f"from {rows} rows"
        return (f"products: C kernels on the GGUF blocks; the library ({str(library_dtype())[6:]} copy) {where} "
                f"(crossover measured on this machine for {probe.out_features}x{probe.in_features})"
                + self._hybrid_note)

    @property
    def _hybrid_note(self) -> str:
        """Where decode and verification steps take the hybrid step (library products, C attention)."""
        if self.runner.hybrid_step is None:
            return ""
        rows = self.runner.hybrid_from()
        if rows is None:
            return "; decode and verification steps: the fused C step at every row count"
        return (f"; decode and verification steps: fused C step below {rows} rows, from {rows} the hybrid step "
                "(library products, attention in C over the pool)")

    @property
    def capacity_lines(self) -> list[str]:
        return list(self.capacity["log_lines"])

    # -- requests ----------------------------------------------------------------------------------

    def encode(self, prompt: Union[str, Sequence[int]]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids", "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids

    def add_request(self, prompt: Union[str, Sequence[int]], params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, now: Optional[float] = None) -> Seq:
        params = params or SamplingParams()
        if params.n != 1:
            raise RequestError(f"n={params.n}: add several samples of one prompt with add_samples", "n")
        ids = self.encode(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", "request_id")
        self._check_extras(params)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        seq = Seq(request_id, ids, params, self.clock() if now is None else now)
        self.scheduler.add(seq)  # refuses what can never fit
        self.logits_processor.start(request_id, params)
        self.requests[request_id] = (seq, self._new_detokenizer(seq))
        self.prompt_tokens_total += len(ids)
        return seq

    def add_samples(self, prompt: Union[str, Sequence[int]], params: SamplingParams,
                    request_id: Optional[str] = None, now: Optional[float] = None) -> list[Seq]:
        """`params.n` samples of one prompt (vLLM's n): sequences "{i}_{request_id}" sharing the prompt's
        blocks (kvlab.engine.parallel_sampling); all are refused if one would be."""
        return add_samples(self, prompt, params, request_id or f"req-{next(self._ids)}", now)

    def _new_detokenizer(self, seq: Seq) -> Optional[Detokenizer]:
        p = seq.params
        return Detokenizer(self.tokenizer, seq.prompt_ids, p.stop, p.include_stop_str_in_output, p.min_tokens) \
            if self.tokenizer is not None else None

    def _check_extras(self, params: SamplingParams) -> None:
        """Refuse the request extras this engine cannot apply (RequestError, HTTP 400)."""
        if self.speculative is not None and (params.processed or params.prompt_logprobs is not None):
            raise RequestError("penalties, logit_bias, min_tokens, structured outputs and prompt_logprobs are not "
                               "supported with speculative decoding (--speculative-config)", "speculative_config")
        self.logits_processor.check(params)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (waiting or running) and free its blocks; unknown ids are ignored."""
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            self._finish(entry[0], "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self.held.groups)

    def reset_prefix_cache(self) -> int:
        """Drop the cached prefixes no request holds (the blocks stay free); how many blocks that was."""
        return self.blocks.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.held)

    # -- the loop ----------------------------------------------------------------------------------

    def step(self, now: Optional[float] = None) -> list[StepDelta]:
        """One step. `now` (seconds) overrides the engine's clock: a simulator's virtual time."""
        planned = self.begin_step(now)
        return [] if planned is None else self.end_step(planned, self.run_step(planned))

    def begin_step(self, now: Optional[float] = None) -> Optional[PlannedStep]:
        """Schedule the next step (None when nothing runs). The three parts of `step` let a server
        take new requests while the model runs: `begin_step` and `end_step` change the engine's
        state; `run_step` changes only the scheduled sequences and their blocks' contents, so
        `add_request` may run beside it (not `abort`, which frees blocks: kvlab.server.async_engine)."""
        virtual = now is not None
        now = now if virtual else self.clock()
        self.held.release(self.scheduler)  # n's siblings join once their first sample's prompt is computed
        scheduled = self.scheduler.schedule(now)
        if not scheduled:
            return None
        starts = [(seq.num_computed, seq.draft_computed) for seq in scheduled.seqs]
        return PlannedStep(scheduled, starts, now if virtual else None)

    def run_step(self, planned: PlannedStep) -> Union[list[list], Exception]:
        """The model's part of a step: each sequence's draws, or the error it raised."""
        scheduled = planned.scheduled
        try:
            tokens = sum(scheduled.num_tokens)
            with self.threads.step(step_kind(len(scheduled.seqs), tokens), tokens):
                return self.runner.run(scheduled)
        except Exception as error:  # noqa: BLE001 - the failing requests fail; the engine and others go on
            log.exception("a model step failed")
            return error

    def end_step(self, planned: PlannedStep, sampled: Union[list[list], Exception]) -> list[StepDelta]:
        """Append what the step drew, finish what stopped, hand back blocks: the step's deltas."""
        scheduled, deltas = planned.scheduled, []
        if isinstance(sampled, Exception):
            sampled = self._isolate(scheduled, planned.starts, sampled, deltas)
        done = planned.now if planned.now is not None else self.clock()
        for seq, draws in zip(scheduled.seqs, sampled):
            if seq.finished:  # failed alone in _isolate
                continue
            self.blocks.commit_full_blocks(seq)
            if self.speculative is not None:
                self.blocks.trim(seq)
            self.blocks.release_outside_window(seq)  # windowed groups hand back what left their window
            delta = None
            for draw in draws:
                piece = self._append(seq, draw, done)
                if delta is None:
                    delta = piece
                else:
                    delta.token_ids += piece.token_ids
                    delta.text += piece.text
                    delta.logprobs += piece.logprobs
                    delta.finished, delta.finish_reason = piece.finished, piece.finish_reason
                if seq.finished:
                    break
            if self.speculative is not None and not seq.finished:
                self.blocks.commit_full_blocks(seq)  # the blocks its accepted drafts just filled
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _isolate(self, scheduled: ScheduledStep, starts: list[tuple[int, int]], error: Exception,
                 deltas: list[StepDelta]) -> list[list]:
        """After a failed step, run its sequences one by one, so only those that fail alone fail.

        The failed step's progress is rolled back (num_computed and the draft's position to
        where they started; nothing was emitted), and rerunning rewrites the same pool slots,
        so each retry is the step it would have been. One bad request then costs its batch
        one step's time, not its answers.
        """
        sampled: list[list] = []
        for seq, n, (computed, drafted) in zip(scheduled.seqs, scheduled.num_tokens, starts):
            seq.num_computed, seq.draft_computed, failure = computed, drafted, error
            if len(scheduled.seqs) > 1:
                try:
                    sampled.append(self.runner.run(ScheduledStep([seq], [n]))[0])
                    continue
                except Exception as alone:  # noqa: BLE001
                    failure = alone
            self.requests.pop(seq.request_id, None)
            self._finish(seq, "abort", f"{type(failure).__name__}: {failure}")
            deltas.append(StepDelta(seq.request_id, finished=True, finish_reason="abort", error=seq.error))
            sampled.append([])
        return sampled

    @property
    def spec_stats(self):
        return self.runner.spec_stats

    def _append(self, seq: Seq, draw, now: float) -> StepDelta:
        seq.output_ids.append(draw.token_id)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        self.generation_tokens_total += 1
        if seq.params.logprobs is not None:
            seq.logprobs.append(draw)
        delta = StepDelta(seq.request_id, [draw.token_id], logprobs=[draw] if seq.params.logprobs is not None else [])
        detok = self.requests[seq.request_id][1]
        eos = self.tokenizer.eos_id if self.tokenizer is not None else None
        reason = None
        if draw.token_id in seq.params.stop_token_ids or (draw.token_id == eos and not seq.params.ignore_eos):
            reason = "stop"
        elif detok is not None:
            delta.text, matched = detok.push(draw.token_id)
            if matched is not None:
                reason = "stop"
        if reason is None and (len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if detok is not None:
                delta.text += detok.flush()
            delta.finished, delta.finish_reason = True, reason
            self.requests.pop(seq.request_id, None)
            self._finish(seq, reason)
        return delta

    def _finish(self, seq: Seq, reason: str, error: Optional[str] = None) -> None:
        seq.error = error
        self.scheduler.finish(seq, reason)
        for callback in self.on_finish:
            callback(seq)

    @torch.inference_mode()
    def run_until_done(self, max_steps: Optional[int] = None) -> list[StepDelta]:
        """Step until no request is left (tests and the offline API); returns every delta."""
        out: list[StepDelta] = []
        for _ in (range(max_steps) if max_steps else itertools.count()):
            if not self.has_unfinished():
                break
            deadline = self.scheduler.next_deadline()
            deltas = self.step()
            if not deltas and deadline is not None and not self.scheduler.running:
                time.sleep(max(0.0, min(0.05, deadline - self.clock())))
            out += deltas
        return out
