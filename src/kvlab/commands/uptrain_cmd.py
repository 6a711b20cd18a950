"""`kvlab uptrain OUT --teacher SRC`: distil a converted model back towards its source.

KL on the teacher's logits (and optionally its hidden states) on text the teacher samples
itself or on `--data FILE`, training the attention (and norms) or everything. The budget is
tokens (`--tokens`, or `--steps`) or training minutes (`--minutes`, turned into steps by timing
the first ones, then fixed). Training resumes from OUT.uptrain.pt (atomic, every
--checkpoint-every steps), so a long run goes in slices (`--stop-after N` more steps,
`--slice-minutes M`); rerunning the same command continues it. When the last step is done the
student replaces OUT's weights, atomically, in OUT's dtype. OUT.uptrain.json records the loss
against tokens as it goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from kvlab.commands.args import non_negative_int, positive_float, positive_int
from kvlab.files import write_json
from kvlab.plan.errors import PlanError

EXAMPLES = """examples:
  kvlab convert smollm2-135m --kv-heads 1 -o smollm2-mqa
  kvlab uptrain smollm2-mqa --teacher smollm2-135m --data pride-and-prejudice.txt --tokens 200000 --slice-minutes 20
  kvlab uptrain s260k-mqa --teacher stories260k --steps 200 --stop-after 100      # rerun to do the next 100
  kvlab uptrain smollm2-mla --teacher smollm2-135m --minutes 60 --train all --hidden-weight 0.1
"""


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", help="the converted model directory (kvlab convert's OUT)")
    parser.add_argument("--teacher", required=True, metavar="SRC", help="the unconverted model (name, .gguf, dir)")
    parser.add_argument("--data", help="a UTF-8 text file to train on (default: text the teacher samples)")
    parser.add_argument("--teacher-tokens", type=positive_int, default=20_000,
                        help="tokens the teacher samples when there is no --data (20000)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=positive_int, help="training tokens in all (steps = tokens / batch tokens)")
    budget.add_argument("--steps", type=positive_int, help="optimiser steps in all (default 200)")
    budget.add_argument("--minutes", type=positive_float,
                        help="training minutes in all: the first steps are timed and the step count fixed from them")
    parser.add_argument("--stop-after", type=positive_int, metavar="N", help="stop this slice after N more steps")
    parser.add_argument("--slice-minutes", type=positive_float, metavar="M",
                        help="stop this slice after M minutes (checkpointed; rerun to continue)")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--block-size", type=positive_int, default=256, help="tokens per training window (256)")
    parser.add_argument("--lr", type=positive_float, default=3e-4, help="peak learning rate (3e-4)")
    parser.add_argument("--train", choices=("attention", "all"), default="attention",
                        help="what trains: the attention and the norms (default; a conversion changed nothing "
                             "else), or every weight")
    parser.add_argument("--alpha", type=float, default=1.0, help="weight of the KL term; 1 - alpha on the LM loss (1)")
    parser.add_argument("--temperature", type=positive_float, default=1.0, help="distillation temperature (1)")
    parser.add_argument("--hidden-weight", type=float, default=0.0,
                        help="weight of the hidden-state distance to the teacher after each block (0: logits only)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=10)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from kvlab.checkpoints.export import GGUF_NAME, load_source, output_dtype, write_outputs
    from kvlab.train.data import eval_batches
    from kvlab.train.distill import DistillTrainer, token_corpus
    from kvlab.train.loop import TrainConfig, mean_loss

    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.isfile(os.path.join(args.out, "config.json")):
        raise PlanError(f"{args.out} is not a model directory; write one with kvlab convert")
    student, teacher = load_source(args.out), load_source(args.teacher)
    if student.model.config.vocab_size != teacher.model.config.vocab_size:
        raise PlanError("the student and the teacher have different vocabularies")
    base = Path(os.path.abspath(args.out))
    checkpoint, record = Path(f"{base}.uptrain.pt"), Path(f"{base}.uptrain.json")
    ids, source = _training_ids(args, student, teacher, Path(f"{base}.uptrain-data.json"))
    corpus = token_corpus(ids, args.block_size, source)
    batch_tokens = args.batch_size * args.block_size
    steps = _planned_steps(args, batch_tokens, Path(f"{base}.uptrain-plan.json"), student, teacher, corpus)
    config = TrainConfig(steps=steps, batch_size=args.batch_size, block_size=args.block_size, lr=args.lr,
                         min_lr=args.lr / 10, warmup=min(20, steps // 10), eval_every=max(1, steps // 8),
                         eval_batches=4, checkpoint_every=args.checkpoint_every, seed=args.seed)
    val = eval_batches(corpus.val, 4, args.batch_size, args.block_size)
    before = mean_loss(student.model, val)
    trainer = DistillTrainer(student.model, teacher.model, corpus, config, checkpoint, alpha=args.alpha,
                             temperature=args.temperature, hidden_weight=args.hidden_weight, train=args.train,
                             record=lambda progress: write_json(record, progress), progress=not args.json,
                             label="uptrain")
    end = None if args.stop_after is None else trainer.state.step + args.stop_after
    state = trainer.fit(stop_after=end, max_seconds=None if args.slice_minutes is None else 60 * args.slice_minutes)
    finished = state.step >= steps
    report = {"out": args.out, "teacher": teacher.path, "data": source, "steps": state.step, "of_steps": steps,
              "tokens": state.tokens, "of_tokens": steps * batch_tokens, "finished": finished,
              "train": args.train, "trainable_parameters": trainer.trainable, "alpha": args.alpha,
              "hidden_weight": args.hidden_weight, "train_seconds": round(state.train_seconds, 1),
              "tokens_per_s": round(state.tokens_per_s, 1), "time_split": _split(trainer.timing),
              "val_lm_loss_before": before, "val_lm_loss_after": mean_loss(student.model, val),
              "record": state.history, "checkpoint": str(checkpoint)}
    write_json(record, report)
    if finished:
        had_gguf = os.path.isfile(os.path.join(args.out, GGUF_NAME))
        if had_gguf:
            student.tokenizer_metadata = teacher.tokenizer_metadata
        write_outputs(student.model, student, args.out, had_gguf and student.tokenizer_metadata is not None, True,
                      dtype=output_dtype("auto", student))
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        split = ", ".join(f"{k} {v:.0%}" for k, v in report["time_split"].items())
        print(f"uptrain {args.out}: {state.step}/{steps} steps, {state.tokens:,} tokens of {source} in "
              f"{state.train_seconds / 60:.1f} min ({report['tokens_per_s']:,.0f} tok/s: {split}); held-out LM loss "
              f"{report['val_lm_loss_before']:.4f} -> {report['val_lm_loss_after']:.4f}; loss record in {record}")
        print(f"weights written to {args.out}" if finished else
              f"resume with the same command (checkpoint {checkpoint})")
    return 0


def _training_ids(args, student, teacher, data_file) -> tuple[list[int], str]:
    """The training text's ids: --data's, or the teacher's samples (drawn once, kept beside OUT for resuming)."""
    tokenizer = student.tokenizer or teacher.tokenizer
    if args.data:
        if tokenizer is None:
            raise PlanError("--data needs a tokenizer; neither model has one")
        try:
            with open(args.data, encoding="utf-8") as handle:
                return tokenizer.encode(handle.read(), add_bos=False), args.data
        except OSError as error:
            raise PlanError(f"cannot read --data {args.data}: {error.strerror or error}") from None
        except UnicodeDecodeError as error:
            raise PlanError(f"{args.data} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    if data_file.exists():  # a resumed run trains on the very samples it started with
        return json.loads(data_file.read_text()), "teacher samples"
    from tqdm import tqdm

    from kvlab.train.distill import teacher_text
    start = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else 0
    with tqdm(total=args.teacher_tokens, desc="teacher samples", unit="tok", file=sys.stderr,
              disable=args.json) as bar:
        ids = teacher_text(teacher.model, args.teacher_tokens, start, seed=args.seed, progress=bar.update)
    write_json(data_file, ids)
    return ids, "teacher samples"


def _planned_steps(args, batch_tokens: int, plan_file, student, teacher, corpus) -> int:
    """The run's step count: from --tokens or --steps, or for --minutes from the time of two timed steps
    (fixed in OUT.uptrain-plan.json at the first slice, so every later slice trains to the same end)."""
    if args.tokens is not None:
        return max(1, math.ceil(args.tokens / batch_tokens))
    if args.minutes is None:
        return args.steps or 200
    if plan_file.exists():
        plan = json.loads(plan_file.read_text())
        if plan.get("minutes") == args.minutes and plan.get("batch_tokens") == batch_tokens:
            return int(plan["steps"])
    seconds = _time_steps(args, student.model, teacher.model, corpus)
    steps = max(1, int(args.minutes * 60 / seconds))
    write_json(plan_file, {"minutes": args.minutes, "batch_tokens": batch_tokens, "seconds_per_step": seconds,
                            "steps": steps})
    return steps


def _time_steps(args, student, teacher, corpus) -> float:
    """Seconds per training step, from two steps' forward and backward passes (weights left unchanged)."""
    import copy
    import time

    from kvlab.train.distill import DistillTrainer
    from kvlab.train.loop import TrainConfig
    probe = copy.deepcopy(student)
    config = TrainConfig(steps=2, batch_size=args.batch_size, block_size=args.block_size, lr=args.lr,
                         min_lr=args.lr / 10, warmup=0, eval_every=10, eval_batches=1, checkpoint_every=10,
                         seed=args.seed)
    trainer = DistillTrainer(probe, teacher, corpus, config, None, alpha=args.alpha, temperature=args.temperature,
                             hidden_weight=args.hidden_weight, train=args.train, progress=False)
    trainer._step()  # the first step warms the allocator and kernels up
    start = time.perf_counter()
    trainer.state.step += 1
    trainer._step()
    return time.perf_counter() - start


def _split(timing: dict) -> dict:
    total = sum(timing.values()) or 1.0
    return {name.removesuffix("_s"): value / total for name, value in timing.items()}

