"""One forward pass for a scheduled step: build the batch description, run the model, sample.

The module-by-module path (kvlab.nn.Decoder with a kvlab.cache.StepBatch) serves every model
and step; it is the reference the C paged step is tested against. Only the sequences whose
step reaches their last token are sampled: a prompt chunk in the middle produces nothing.

With speculative decoding (kvlab.engine.speculative), each decoding sequence first gets up
to k drafted tokens from its proposer; the target then reads [last token, drafts] in the
same pass as everyone else's prompt chunks, and the acceptance rule decides what is
emitted. The K/V the target wrote for rejected drafts lie past `num_computed`: they are
never read, and their blocks are handed back (BlockManager.trim).

Where the C paged step applies, a step in which every sequence decodes (plain decode, or
speculative verification of [last token, drafts]) is one C call, each fed token a row of its
own at its own position (kvlab.nn.paged_decode, `PagedDecodeStep.feeds`); so are the
proposers' rounds: the self-draft as the C step cut to the target's first layers, a draft
model as its own C step over its side of the pool (the engine packs it to Q8_0 for this).
Where the step's rows (one per decoding sequence, k + 1 per verification) are at or above the
crossover below, a decode or verification step takes the hybrid step instead (kvlab.nn.hybrid_step:
the products in the library, attention in C over the pool, the same calls), and below it the
fused step: a batch-1 step is always the fused one. Steps that carry prompt chunks run in C too,
every prompt token a row (scores only for the rows that are sampled), up to C_PROMPT_CONTEXT tokens
of context and where the step's rows are fewer than the machine's measured crossover to the library's products (kvlab.nn.matmul_backend);
past either, and for a draft model's catch-up over a whole prompt, module by module, where each
product of that many rows goes to the library.

Test hook: with KVLAB_FAULT_INJECT=ID in the environment, a step that feeds token ID from a
prompt raises RuntimeError before the model runs, as a failing kernel would; the reliability
tests use it to check that such a request fails alone and frees its blocks. Unset, it costs
one comparison per step.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.engine.errors import RequestError
from kvlab.engine.sampling import Sampled, SamplingParams, draw, drawn, filtered_logits, sample_rows
from kvlab.engine.scheduler import ScheduledStep, draft_budget
from kvlab.engine.sequence import Sequence
from kvlab.engine.eagle_proposer import record_features
from kvlab.engine.speculative import SpecStats, SpeculativeConfig, accept, ngram_proposal, target_probs
from kvlab.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_rows
from kvlab.nn.matmul_backend import uses_library
from kvlab.nn.threads import one_thread

PagedStep = Callable[[torch.Tensor, StepBatch], torch.Tensor]  # (ids [S], decode batch) -> logits [S, V]
C_FEED_LIMIT = 16  # a proposer round feeding more tokens than this for a sequence (a prompt) runs module by module
# Up to this context, a step that reads prompt tokens runs them in the C step as rows of their own (every
# decode row of the step with them). Each row there attends alone over its whole context, while the module
# path's SDPA shares each key block among a tile of queries: past a few thousand tokens a prompt's rows cost
# more in attention than in the weights. Where a step's rows multiply faster in the library (a crossover
# measured per machine, kvlab.nn.matmul_backend), steps with prompt tokens run module by module instead.
C_PROMPT_CONTEXT = 2048


def group_tables(seqs: list[Sequence], groups: int) -> list[list[list[int]]]:
    """The sequences' block tables, per KV group: [group][sequence]."""
    return [[seq.block_tables[g] for seq in seqs] for g in range(groups)]


class ModelRunner:
    def __init__(self, model, pool: KVPool, seed: int = 0, paged_step: Optional[PagedStep] = None,
                 speculative: Optional[SpeculativeConfig] = None, draft_model=None, draft_pool: Optional[KVPool] = None,
                 max_model_len: Optional[int] = None, draft_step=None, head=None) -> None:
        self.model, self.pool = model, pool
        self.generator = torch.Generator().manual_seed(seed)
        # Penalties, logit_bias, min_tokens and grammar masks (kvlab.engine.logits_process), set by the
        # engine; it leaves the rows of plain requests alone.
        self.logits_processor = None
        self.paged_step = paged_step  # a fused decode step over the pool, where one applies
        # its twin with the products in the library, for decode and verification steps past the crossover
        self.hybrid_step = None
        from kvlab.nn.paged_decode import PagedDecodeStep
        if isinstance(paged_step, PagedDecodeStep):
            from kvlab.nn.hybrid_step import hybrid_step_for
            self.hybrid_step = hybrid_step_for(model, pool, paged_step.max_rows)
        self._probe = None  # the product whose crossover decides where prompt steps run (_on_library)
        fault = os.environ.get("KVLAB_FAULT_INJECT", "").strip()
        self.fault_token = int(fault) if fault.lstrip("-").isdigit() else None
        self.spec, self.draft_model, self.draft_pool = speculative, draft_model, draft_pool
        self.spec_stats = SpecStats()
        self.max_model_len = max_model_len or model.config.max_seq_len
        self.draft_step = draft_step  # the draft model's C step over draft_pool, where one applies
        self.head_proposer = None  # an EAGLE or Medusa head: it reads the target's final hidden states
        if head is not None:
            from kvlab.nn.medusa import MedusaHead
            if isinstance(head, MedusaHead):
                from kvlab.engine.medusa_proposer import MedusaProposer
                self.head_proposer = MedusaProposer(head)
            else:
                from kvlab.engine.eagle_proposer import EagleProposer
                self.head_proposer = EagleProposer(head, model)
        if speculative is not None and speculative.method == "self":
            layers = model.config.n_layers
            self.self_layers = speculative.num_layers or max(1, layers // 4)
            if not 1 <= self.self_layers < layers:
                raise RequestError(f"a self-draft needs 1 to {layers - 1} of the target's {layers} layers, "
                                   f"got num_layers={self.self_layers}", "speculative_config")
            if paged_step is not None:
                from kvlab.nn.paged_decode import PagedDecodeStep
                self.draft_step = PagedDecodeStep(model, pool, paged_step.max_rows, self.self_layers)

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> list[list[Sampled]]:
        """Feed each sequence its scheduled tokens; per sequence, the tokens it emits this step (often none or one)."""
        if self.fault_token is not None:
            self._maybe_fault(step)
        seqs = step.seqs
        decoding = [seq.num_computed == seq.num_tokens - 1 and n == 1 for seq, n in zip(seqs, step.num_tokens)]
        drafts: list[list[int]] = [[] for _ in seqs]
        q: list[Optional[torch.Tensor]] = [None] * len(seqs)
        if self.spec is not None and any(decoding):
            drafts, q = self._propose(seqs, decoding)
        feeds = [[seq.all_ids[seq.num_computed]] + d if dec else
                 seq.all_ids[seq.num_computed:seq.num_computed + n]
                 for seq, n, dec, d in zip(seqs, step.num_tokens, decoding, drafts)]
        lens = [len(f) for f in feeds]
        tables = group_tables(seqs, len(self.pool.groups))
        batch = StepBatch.build([seq.num_computed for seq in seqs], lens, block_size=self.pool.block_size,
                                group_tables=tables, seats=[seq.seat or 0 for seq in seqs])
        ends = torch.tensor(lens).cumsum(0)
        hidden = None  # every fed row's final hidden state, for a draft head
        if self.paged_step is not None and batch.is_decode and self.head_proposer is None:
            logits = self.decode_step(len(seqs))(torch.tensor([t for f in feeds for t in f]), batch)
            rows = [[i] for i in range(len(seqs))]
        else:  # prompts (chunks), verifications, or a mix with decodes: logits for the rows that are read
            # every row of a feed where drafts are verified or prompt log-probabilities asked for, else the last
            picks = [list(range(int(end) - n, int(end))) if d or wants_prompt_rows(seq) else [int(end) - 1]
                     for end, n, d, seq in zip(ends, lens, drafts, seqs)]
            flat = [r for rs in picks for r in rs]
            in_c = all(decoding) or (max(batch.context_lens) <= C_PROMPT_CONTEXT
                                     and not self._on_library(int(ends[-1])))
            if self.paged_step is not None and in_c:  # a row per token, in C
                if self.head_proposer is not None:
                    hidden = torch.empty(int(ends[-1]), self.model.config.dim)
                step = self.decode_step(int(ends[-1])) if all(decoding) else self.paged_step
                logits = step.feeds(feeds, [seq.num_computed for seq in seqs], tables, logit_rows=flat, hidden=hidden,
                                    seats=batch.seats)
            elif self.head_proposer is not None:
                logits, hidden = self.model(torch.tensor([[t for f in feeds for t in f]]), self.pool, step=batch,
                                            rows=torch.tensor(flat), with_hidden=True)
                logits, hidden = logits[0], hidden[0]
            else:
                logits = self.model(torch.tensor([[t for f in feeds for t in f]]), self.pool, step=batch,
                                    rows=torch.tensor(flat))[0]
            rows, at = [], 0
            for rs in picks:
                rows.append(list(range(at, at + len(rs))))
                at += len(rs)
        out: list[list[Sampled]] = [[] for _ in seqs]
        plain = []
        for i, (seq, n) in enumerate(zip(seqs, lens)):
            start = seq.num_computed
            if drafts[i]:
                with one_thread():
                    out[i] = self._verify(seq, drafts[i], logits[rows[i]], q[i])
            if hidden is not None:  # the rows whose K/V stay: a prompt chunk's all, a verification's accepted
                first = int(ends[i]) - n
                kept = seq.num_computed - start if drafts[i] else n
                record_features(seq, start, hidden[first:first + kept], self.head_proposer.window)
            if not drafts[i]:
                if seq.params.prompt_logprobs is not None:  # the rows read for this feed end at its last token
                    record_prompt_logprobs(seq, logits[rows[i]], seq.num_computed + n - len(rows[i]))
                seq.num_computed += n
                if seq.num_computed == seq.num_tokens:
                    plain.append(i)
        if plain:
            picked = [rows[i][-1] for i in plain]
            # a plain decode step samples every row in order: its own logits tensor, not a gathered copy
            # (16 rows of Gemma 3's 262,144 scores are 16 MiB copied per step for nothing)
            whole = picked == list(range(logits.shape[0]))
            chosen, raw = (logits if whole else logits[picked]), None
            if self.logits_processor is not None:
                with one_thread():  # as the sampler (kvlab.nn.threads.one_thread)
                    chosen, raw = self.logits_processor.apply(chosen, [seqs[i] for i in plain])
            drawn = sample_rows(chosen, [seqs[i].params for i in plain],
                                [seqs[i].generator for i in plain], self.generator, raw)
            for i, sampled in zip(plain, drawn):
                out[i] = [sampled]
        return out

    def probe_layer(self):
        """The product whose crossover decides where prompt steps run: the first layer's widest GGUF
        matrix (its MLP's up projection), or None for a model without GGUF blocks."""
        if self._probe is None:
            from kvlab.nn.ggml import GGMLLinear
            layers = [m for m in self.model.blocks[0].modules() if isinstance(m, GGMLLinear)]
            self._probe = max(layers, key=lambda m: m.out_features * m.in_features) if layers else False
        return self._probe or None

    def decode_step(self, rows: int):
        """The step for a decode or verification of `rows` fed tokens: the hybrid one (library products, C
        attention) where those rows multiply faster in the library, else the fused C step."""
        return self.hybrid_step if self.hybrid_step is not None and self._on_library(rows) else self.paged_step

    def hybrid_from(self) -> Optional[int]:
        """The fewest rows a decode step of this engine takes the hybrid step at, None for never (start-up log)."""
        if self.hybrid_step is None:
            return None
        return next((rows for rows in range(2, self.hybrid_step.max_rows + 1) if self._on_library(rows)), None)

    def _on_library(self, rows: int) -> bool:
        """Whether a step of `rows` fed tokens multiplies faster in the library than in C."""
        probe = self.probe_layer()
        return probe is not None and uses_library(probe, rows)

    def _maybe_fault(self, step: ScheduledStep) -> None:
        for seq, n in zip(step.seqs, step.num_tokens):
            if self.fault_token in seq.prompt_ids[seq.num_computed:seq.num_computed + n]:
                raise RuntimeError(f"injected fault (KVLAB_FAULT_INJECT={self.fault_token}) in {seq.request_id}")

    # -- speculation -------------------------------------------------------------------------------

    def _budget(self, seq: Sequence) -> int:
        """Drafts this sequence may take: k, within its reserved slots, max_tokens and the model length."""
        return draft_budget(self.spec.num_speculative_tokens, seq.params.max_tokens, len(seq.output_ids),
                            self.max_model_len, seq.num_tokens, len(seq.block_table) * self.pool.block_size
                            - seq.num_tokens)

    def _propose(self, seqs: list[Sequence], decoding: list[bool]) -> tuple[list[list[int]], list]:
        spec = self.spec
        busy = spec.disable_by_batch_size is not None and len(seqs) >= spec.disable_by_batch_size
        budgets = [self._budget(seq) if dec and not busy else 0 for seq, dec in zip(seqs, decoding)]
        if self.head_proposer is not None:
            return self.head_proposer.propose(seqs, budgets, self.generator)
        if spec.method == "ngram":
            return ([ngram_proposal(seq.all_ids, b, spec.prompt_lookup_min, spec.prompt_lookup_max) if b else []
                     for seq, b in zip(seqs, budgets)], [None] * len(seqs))
        return self._model_drafts(seqs, budgets)

    def _model_drafts(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[int]], list]:
        """k rounds of the proposer (the target's first layers, or the draft model) over the drafting sequences."""
        active = [i for i, b in enumerate(budgets) if b > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        if not active:
            return drafts, [None] * len(seqs)
        own = self.spec.method == "draft_model"
        model, pool = (self.draft_model, self.draft_pool) if own else (self.model, self.pool)
        layers = None if own else self.self_layers
        for round_ in range(max(budgets[i] for i in active)):
            live = [i for i in active if budgets[i] > round_]
            starts, feeds = [], []
            for i in live:
                seq = seqs[i]
                ids = seq.all_ids + drafts[i]
                begin = seq.draft_computed if own and round_ == 0 else seq.num_tokens - 1 + round_
                starts.append(begin)
                feeds.append(ids[begin:seq.num_tokens + round_])
            tables = group_tables([seqs[i] for i in live], len(pool.groups))
            if self.draft_step is not None and max(len(f) for f in feeds) <= C_FEED_LIMIT:
                logits = self.draft_step.feeds(feeds, starts, tables)[torch.tensor([len(f) for f in feeds]).cumsum(0) - 1]
            else:
                batch = StepBatch.build(starts, [len(f) for f in feeds], block_size=pool.block_size,
                                        group_tables=tables)
                logits = model(torch.tensor([[t for f in feeds for t in f]]), pool, last_only=True, step=batch,
                               num_layers=layers)[0]
            for row, i in enumerate(live):
                seq = seqs[i]
                if seq.params.greedy:
                    token, dist = int(logits[row].argmax()), None
                else:
                    dist = torch.softmax(filtered_logits(logits[row], seq.params), dim=-1)
                    token = draw(dist[None], seq.generator or self.generator)[0]
                drafts[i].append(token)
                dists[i].append(dist)
        q = [torch.stack(d) if d and d[0] is not None else None for d in dists]
        return drafts, q

    def _verify(self, seq: Sequence, drafts: list[int], logits: torch.Tensor, q) -> list[Sampled]:
        params: SamplingParams = seq.params
        p = logits if params.greedy else target_probs(logits, params)
        tokens, accepted = accept(drafts, p, q, params, seq.generator or self.generator)
        self.spec_stats.record(len(drafts), accepted)
        start = seq.num_computed
        seq.num_computed = start + 1 + accepted  # the last token and the accepted drafts hold valid K/V
        if self.spec.method == "draft_model":  # the draft wrote K/V for [last, drafts[:-1]]
            seq.draft_computed = start + 1 + min(accepted, len(drafts) - 1)
        return [drawn(token, logits[j], params) for j, token in enumerate(tokens)]
