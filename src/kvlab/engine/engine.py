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

from kvlab.cache.base import model_dtype_name
from kvlab.cache.pool import DEFAULT_BLOCK_SIZE, KVPool
from kvlab.engine.block_manager import BlockManager
from kvlab.engine.detokenizer import Detokenizer
from kvlab.engine.errors import RequestError
from kvlab.engine.logits_process import LogitsProcessor
from kvlab.engine.memory_budget import utilization_budget
from kvlab.engine.outputs import StepDelta
from kvlab.engine.parallel_sampling import HeldSiblings, add_samples
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from kvlab.engine.sequence import Sequence as Seq
from kvlab.engine.speculative import SpeculativeConfig
from kvlab.nn.matmul_backend import NEVER, backend, crossover, library_dtype
from kvlab.nn.threads import ThreadGovernor, step_kind
from kvlab.plan.capacity import cache_formats
from kvlab.plan.speculative import shared_pool_blocks
from kvlab.plan.units import parse_bytes
from kvlab.plan.kv_formats import KVQUANT
from kvlab.plan.pool_capacity import DEFAULT_MAX_NUM_SEQS, engine_capacity, uses_seats

log = logging.getLogger("kvlab.engine")
DEFAULT_MEMORY_FRACTION = 0.1  # of the machine's available memory, when no --kv-cache-memory is given


@dataclass
class EngineConfig:
    """vLLM's knobs (plus the seeds' max_wait_ms); see `kvlab serve --help`."""

    kv_cache_dtype: str = "auto"
    kv_cache_memory: Optional[Union[int, str]] = None  # bytes or "2GiB"; None: a share of available memory
    kv_cache_memory_fraction: float = DEFAULT_MEMORY_FRACTION
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None  # None: the model's own context length
    max_wait_ms: float = 0.0
    enable_prefix_caching: bool = True
    seed: int = 0
    paged_step: bool = True  # run steps in kvlab's C paged step where the model and pool allow
    speculative_config: object = None  # vLLM's speculative_config: a dict, its JSON text, or SpeculativeConfig
    kv_window: Optional[int] = None  # StreamingLLM's sinks + window policy: blocks out of the window are handed back
    sink_tokens: int = 0
    # vLLM's flags with their CPU meaning (kvlab.engine.memory_budget): the fraction of host memory kvlab may
    # use (weights included; the pool gets the rest), and one process (tensor / pipeline parallel 1)
    gpu_memory_utilization: Optional[float] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # kvquant3/kvquant4's codebooks and key ranges (`kvlab calibrate-kv`), as `kvlab eval --kv-calibration`
    kv_calibration: Optional[str] = None
    # keys cached before RoPE and rotated once read (`kvlab eval --pre-rope-keys`; KVQuant's always are)
    pre_rope_keys: bool = False

    def __post_init__(self) -> None:
        # LLM("smollm2-135m", kv_cache_memory="2GiB") reads as the CLI flag does; a bad size is
        # a one-line PlanError (a KvlabError), never a TypeError deep in the pool's sizing.
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if (self.kv_window is not None and self.kv_window <= 0) or self.sink_tokens < 0:
            raise RequestError(f"--kv-window must be positive and --sink-tokens non-negative, got "
                               f"{self.kv_window} and {self.sink_tokens}", "kv_window")
        if self.sink_tokens and self.kv_window is None:
            raise RequestError("--sink-tokens needs --kv-window", "sink_tokens")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}",
                               "gpu_memory_utilization")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise RequestError(f"--{name.replace('_', '-')} {getattr(self, name)}: kvlab runs the model in one "
                                   "CPU process, so only 1 is supported", name)


def shared_capacity(target, draft, budget: int, max_model_len: int, formats, block_size: int) -> dict:
    """The pool's blocks and start-up lines when each block holds the target's and the draft's K/V."""
    blocks, target_block, draft_block = shared_pool_blocks(target, draft, budget, formats, block_size)
    tokens = blocks * block_size
    return {"num_gpu_blocks": blocks, "block_bytes_all_layers": target_block + draft_block,
            "log_lines": [f"Available KV cache memory: {budget / 2**30:.2f} GiB",
                          f"CPU KV cache size: {tokens:,} tokens (each block holds the target's and the draft's K/V)",
                          f"Maximum concurrency for {max_model_len:,} tokens per request: {tokens / max_model_len:.2f}x"]}


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the machine can give without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
        self.max_model_len = min(config.max_model_len or mc.max_seq_len, mc.max_seq_len)
        if config.max_model_len and config.max_model_len > mc.max_seq_len:
            raise RequestError(f"--max-model-len {config.max_model_len} exceeds the model's {mc.max_seq_len} tokens")
        if config.kv_cache_memory:
            budget = config.kv_cache_memory
        elif config.gpu_memory_utilization is not None:  # vLLM's CPU reading of the flag (kvlab.engine.memory_budget)
            budget = utilization_budget(config.gpu_memory_utilization, available_memory_bytes())
        else:
            budget = int(config.kv_cache_memory_fraction * available_memory_bytes())
        formats = cache_formats(config.kv_cache_dtype, model_dtype=model_dtype_name(model.dtype))
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        draft = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            from kvlab.engine.llm import load_for_engine
            import os
            draft, draft_tokenizer = load_for_engine(os.path.expanduser(self.speculative.model), "dense")
            if draft.config.vocab_size != mc.vocab_size:
                raise RequestError(f"the draft's vocabulary ({draft.config.vocab_size}) is not the target's "
                                   f"({mc.vocab_size}): it must share the tokenizer", "speculative_config")
        head = None
        if self.speculative is not None and self.speculative.method in ("eagle", "medusa"):
            import os
            from kvlab.nn.draft_head import load_draft_head
            head = load_draft_head(os.path.expanduser(self.speculative.model), mc,  # another target's: one line
                                   f"kvlab-{self.speculative.method}-head")
            heads = getattr(head.config, "num_heads", None) if self.speculative.method == "medusa" else None
            if heads is not None and self.speculative.num_speculative_tokens > heads:
                raise RequestError(f"num_speculative_tokens={self.speculative.num_speculative_tokens} but the Medusa "
                                   f"head set at {self.speculative.model} has {heads} heads", "speculative_config")
        # vLLM's CPU backend's arithmetic and lines (this engine's pool lives in host memory), at our block size;
        # with a draft model every block holds both models' K/V (kvlab.plan.speculative, as `kvlab plan --draft`)
        windowed = config.kv_window is not None
        if windowed and self.speculative is not None:
            raise RequestError("--kv-window with speculative decoding is not supported yet", "kv_window")
        # KIVI and KVQuant keep state per seat (kvlab.cache.kivi_pool, kvquant_pool): a KIVI residual, KVQuant's sinks
        # and key outliers
        seated = uses_seats(formats)
        if config.pre_rope_keys and windowed:
            raise RequestError("--pre-rope-keys rotates every cached key at its position; --kv-window drops "
                               "positions", "pre_rope_keys")
        if seated and (self.speculative is not None or windowed):
            raise RequestError(f"{formats.k.name} pools keep per-sequence state in seats; speculative decoding and "
                               "--kv-window are not supported with them", "kv_cache_dtype")
        seats = config.max_num_seqs if seated else 0
        calibration = self._calibration(formats, mc)
        if draft is None:
            spec = mc.to_plan_spec().with_kv_window(config.kv_window, config.sink_tokens) if windowed \
                else mc.to_plan_spec()
            self.capacity = engine_capacity(spec, budget, self.max_model_len, formats, config.block_size, seats,
                                            config.max_num_batched_tokens)
        else:
            self.capacity = shared_capacity(mc.to_plan_spec(), draft.config.to_plan_spec(), budget,
                                            self.max_model_len, formats, config.block_size)
        if head is not None:  # no K/V of its own: each running sequence keeps `window` hidden states
            window = getattr(head.config, "window", 1)
            kind = "EAGLE head" if self.speculative.method == "eagle" else f"Medusa heads ({head.config.num_heads})"
            self.capacity["log_lines"].append(
                f"{kind}: no KV cache; {window} hidden states ({window * mc.dim * 4:,} B) "
                f"per running sequence, {head.config.param_count() / 1e6:.1f}M parameters, "
                f"draft vocabulary {head.config.draft_vocab:,}")
        num_blocks = self.capacity["num_gpu_blocks"]
        if num_blocks < 1:
            raise RequestError(f"a KV cache budget of {budget:,} B holds no {config.block_size}-token block "
                               f"({self.capacity['block_bytes_all_layers']:,} B); raise --kv-cache-memory")
        if draft is not None and any(layer is not None for layer in mc.sliding_windows):
            raise RequestError("a draft model shares the pool's blocks with a target of one KV group; "
                               f"{mc.name} has sliding layers", "speculative_config")
        self.pool = KVPool.for_model(mc, num_blocks, config.block_size, config.kv_cache_dtype, model.dtype,
                                     kv_window=config.kv_window, sink_tokens=config.sink_tokens, seats=seats,
                                     calibration=calibration, max_tokens=self.max_model_len,
                                     pre_rope=config.pre_rope_keys)
        draft_pool = KVPool.for_model(draft.config, num_blocks, config.block_size, config.kv_cache_dtype) \
            if draft is not None else None
        # a KIVI pool's blocks hold what was quantised when they were written, which depends on the
        # sequence's length then: a prefix computed in another sequence is not the same bytes; a KVQuant
        # prefix's sinks and key outliers sit in the seat of the sequence that computed it
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching and not seated,
                                   self.pool.groups, seats)
        lookahead = self.speculative.num_speculative_tokens if self.speculative else 0
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.max_wait_ms, lookahead), self.blocks)
        paged_step = draft_step = None
        # the C step reads keys rotated when written, or a KVQuant pool's pre-RoPE keys (rotated after decoding)
        if config.paged_step and (not self.pool.pre_rope or self.pool.kvquant is not None):
            from kvlab.nn.paged_decode import paged_step_for
            paged_step = paged_step_for(model, self.pool, config.max_num_seqs)
            if draft is not None and paged_step is not None and draft.packing == "dense" and not draft.config.bias:
                from kvlab.nn.pack import pack_q8_0  # a trained draft is dense: Q8_0 lets the C step run it
                packed = pack_q8_0(draft)
                draft_step = paged_step_for(packed, draft_pool, config.max_num_seqs)
                draft = packed if draft_step is not None else draft
        self.runner = ModelRunner(model, self.pool, config.seed, paged_step, self.speculative, draft, draft_pool,
                                  self.max_model_len, draft_step, head)
        self.decode_path = "fused C step" if paged_step is not None else "module by module"
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

    def _calibration(self, formats, config):
        """KVQuant's calibration for this model (None for other formats); a missing or mismatched file is one line."""
        if formats.k.scheme != KVQUANT:
            return None
        if not self.config.kv_calibration:
            raise RequestError(f"{formats.k.name} needs a KVQuant calibration: give --kv-calibration FILE "
                               "(`kvlab calibrate-kv MODEL --data FILE` writes one beside the model)", "kv_calibration")
        from kvlab.cache.kvquant_calibration import load_calibration
        return load_calibration(self.config.kv_calibration, config)

    @property
    def products_line(self) -> str:
        """Where this engine's products run (kvlab.nn.matmul_backend): logged at start-up, and in provenance."""
        probe = self.runner.probe_layer()
        if probe is None:
            return "products: torch on the model's own weights (no GGUF blocks)"
        setting = backend()
        if setting != "auto":
            return f"products: --matmul-backend {setting}"
        rows = crossover(probe)  # measured here the first time on this machine, then remembered
        where = "never" if rows >= NEVER else f"from {rows} rows"
        return (f"products: C kernels on the GGUF blocks; the library ({str(library_dtype())[6:]} copy) {where} "
                f"(crossover measured on this machine for {probe.out_features}x{probe.in_features})")

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
