"""`kvlab uptrain OUT --teacher SRC`: distil a converted model back towards its source.

KL on the teacher's logits plus the language-model loss (kvlab.train.distill), on text the
teacher samples itself or on `--data FILE`. Training resumes from OUT.uptrain.pt (written
atomically every --checkpoint-every steps), so a long run can go in slices (`--stop-after`);
when the last step is done the student replaces OUT's weights, atomically, and the steps and
tokens used are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvlab.commands.args import non_negative_int, positive_float, positive_int
from kvlab.files import write_atomic
from kvlab.plan.errors import PlanError

EXAMPLES = """examples:
  kvlab convert stories260k --kv-heads 1 -o s260k-mqa
  kvlab uptrain s260k-mqa --teacher stories260k --steps 200
  kvlab uptrain smollm2-mqa --teacher smollm2-135m --data ../shared/data/tinyshakespeare.txt --steps 500 --stop-after 100
"""


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", help="the converted model directory (kvlab convert's OUT)")
    parser.add_argument("--teacher", required=True, metavar="SRC", help="the unconverted model (name, .gguf, dir)")
    parser.add_argument("--data", help="a UTF-8 text file to train on (default: text the teacher samples)")
    parser.add_argument("--teacher-tokens", type=positive_int, default=20_000,
                        help="tokens the teacher samples when there is no --data (20000)")
    parser.add_argument("--steps", type=positive_int, default=200, help="optimiser steps in all (200)")
    parser.add_argument("--stop-after", type=positive_int, help="stop this slice once this many steps are done")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--block-size", type=positive_int, default=128, help="tokens per training window (128)")
    parser.add_argument("--lr", type=positive_float, default=3e-4, help="peak learning rate (3e-4)")
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the KL term; 1 - alpha on the LM loss")
    parser.add_argument("--temperature", type=positive_float, default=1.0, help="distillation temperature (1)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=50)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvlab.checkpoints.export import load_source, write_outputs, GGUF_NAME
    from kvlab.train.distill import DistillTrainer, teacher_text, token_corpus
    from kvlab.train.loop import TrainConfig, mean_loss
    from kvlab.train.data import eval_batches

    if not os.path.isfile(os.path.join(args.out, "config.json")):
        raise PlanError(f"{args.out} is not a model directory; write one with kvlab convert")
    student, teacher = load_source(args.out), load_source(args.teacher)
    if student.model.config.vocab_size != teacher.model.config.vocab_size:
        raise PlanError("the student and the teacher have different vocabularies")
    tokenizer = student.tokenizer or teacher.tokenizer
    base = Path(os.path.abspath(args.out))
    checkpoint, data_file = Path(f"{base}.uptrain.pt"), Path(f"{base}.uptrain-data.json")
    if args.data:
        with open(args.data, encoding="utf-8") as handle:
            if tokenizer is None:
                raise PlanError("--data needs a tokenizer; neither model has one")
            ids, source = tokenizer.encode(handle.read(), add_bos=False), args.data
    elif data_file.exists():  # a resumed run trains on the very samples it started with
        ids, source = json.loads(data_file.read_text()), "teacher samples"
    else:
        start = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else 0
        from tqdm import tqdm
        with tqdm(total=args.teacher_tokens, desc="teacher samples", unit="tok", file=sys.stderr) as bar:
            ids = teacher_text(teacher.model, args.teacher_tokens, start, seed=args.seed, progress=bar.update)
        source = "teacher samples"
        write_atomic(data_file, json.dumps(ids))
    corpus = token_corpus(ids, args.block_size, source)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, block_size=args.block_size, lr=args.lr,
                         min_lr=args.lr / 10, warmup=min(20, args.steps // 10), eval_every=max(1, args.steps // 4),
                         eval_batches=4, checkpoint_every=args.checkpoint_every, seed=args.seed)
    val = eval_batches(corpus.val, 4, args.batch_size, args.block_size)
    before = mean_loss(student.model, val)
    trainer = DistillTrainer(student.model, teacher.model, corpus, config, checkpoint, alpha=args.alpha,
                             temperature=args.temperature, progress=not args.json, label="uptrain")
    state = trainer.fit(stop_after=args.stop_after)
    finished = state.step >= args.steps
    if finished:
        had_gguf = os.path.isfile(os.path.join(args.out, GGUF_NAME))
        if had_gguf:
            student.tokenizer_metadata = teacher.tokenizer_metadata
        write_outputs(student.model, student, args.out, had_gguf and student.tokenizer_metadata is not None, True)
    report = {"out": args.out, "teacher": teacher.path, "data": source, "steps": state.step, "of_steps": args.steps,
              "tokens": state.tokens, "finished": finished, "val_lm_loss_before": before,
              "val_lm_loss_after": mean_loss(student.model, val), "checkpoint": str(checkpoint)}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(f"uptrain {args.out}: {state.step}/{args.steps} steps, {state.tokens:,} tokens of {source}; "
              f"held-out LM loss {report['val_lm_loss_before']:.4f} -> {report['val_lm_loss_after']:.4f}"
              + ("; weights written to OUT" if finished else f"; resume with the same command ({checkpoint})"))
    return 0
