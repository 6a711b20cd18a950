"""Passkey retrieval (Mohtashami & Jaggi, 2023): find a 5-digit key hidden in filler text.

A prompt is an instruction, filler up to `depth` of the target length, the key sentence,
more filler, then the question; success is the exact digits in the greedy answer. The
filler and everything before the key are the same in every trial of a (length, depth) cell,
so that part is fed through the cache once and the cache copied for each trial: only the
tokens from the key onward cost a forward pass per trial. Keys come from a seeded generator
keyed by the cell, so every setting sees the same keys (a paired comparison).
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvlab.evals.setting import EvalError

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER_TOKENS = 8  # greedy tokens read back: enough for " 12345" in any tokenizer kvlab loads


@dataclass(frozen=True)
class PasskeyPrompt:
    """The shared part (instruction + filler before the key) and one trial's rest (key onward)."""

    prefix: list[int]
    suffix: list[int]
    key: str

    @property
    def length(self) -> int:
        return len(self.prefix) + len(self.suffix)


def trial_key(seed: int, length: int, depth: float, trial: int) -> str:
    """The 5-digit key of one trial: the same for every setting, different across cells and trials."""
    return str(random.Random(f"passkey:{seed}:{length}:{depth:.4f}:{trial}").randint(10000, 99999))


def build_prompt(tokenizer, length: int, depth: float, key: str) -> PasskeyPrompt:
    """A prompt of about `length` tokens (within one filler sentence) with the key `depth` of the way in."""
    if not 0.0 <= depth <= 1.0:
        raise EvalError(f"passkey depths must be in [0, 1], got {depth}")
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    head = bos + tokenizer.encode(INSTRUCTION, add_bos=False)
    filler = tokenizer.encode(FILLER, add_bos=False)
    key_ids = tokenizer.encode(KEY_SENTENCE.format(key=key), add_bos=False)
    question = tokenizer.encode(QUESTION, add_bos=False)
    room = length - len(head) - len(key_ids) - len(question)
    if room < len(filler):
        raise EvalError(f"passkey length {length} leaves no room for filler (needs > "
                        f"{len(head) + len(key_ids) + len(question) + len(filler)} tokens)")
    repeats = room // len(filler)
    before = round(repeats * depth)
    return PasskeyPrompt(head + filler * before, key_ids + filler * (repeats - before) + question, key)


def answer_digits(text: str) -> Optional[str]:
    """The first run of digits in the model's answer, or None."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


@torch.no_grad()
def feed(model, ids: list[int], cache, chunk: int) -> Optional[torch.Tensor]:
    """Feed `ids` through the cache in chunks; the last position's logits [vocab] (None for no ids)."""
    logits = None
    for start in range(0, len(ids), chunk):
        piece = torch.tensor([ids[start:start + chunk]], dtype=torch.long)
        logits = model(piece, cache=cache, last_only=True)[0, -1]
    return logits


@torch.no_grad()
def answer(model, tokenizer, cache, suffix: list[int], chunk: int) -> str:
    """Feed a trial's suffix after the shared prefix, then decode the greedy answer."""
    logits = feed(model, suffix, cache, chunk)
    out: list[int] = []
    for _ in range(ANSWER_TOKENS):
        token = int(logits.argmax())
        if token == tokenizer.eos_id:
            break
        out.append(token)
        logits = model(torch.tensor([[token]]), cache=cache, last_only=True)[0, -1]
    return tokenizer.decode(out)


def run_cell(model, tokenizer, make_cache: Callable[[int], object], length: int, depth: float, trials: int,
             seed: int, chunk: int, on_trial: Optional[Callable[[], None]] = None) -> dict:
    """Accuracy of one (length, depth) cell over `trials` keys; the prefix is computed once per cell."""
    prompts = [build_prompt(tokenizer, length, depth, trial_key(seed, length, depth, t)) for t in range(trials)]
    longest = max(p.length for p in prompts) + ANSWER_TOKENS
    base = make_cache(longest)
    feed(model, prompts[0].prefix, base, chunk)
    answers, hits = [], 0
    for prompt in prompts:
        cache = copy.deepcopy(base, memo={id(model): model, id(model.rope): model.rope})
        text = answer(model, tokenizer, cache, prompt.suffix, chunk)
        hit = answer_digits(text) == prompt.key
        hits += hit
        answers.append({"key": prompt.key, "answer": text.strip()[:40], "correct": hit})
        if on_trial is not None:
            on_trial()
    return {"length": length, "depth": depth, "prompt_tokens": prompts[0].length, "key_position": len(prompts[0].prefix),
            "trials": trials, "correct": hits, "accuracy": hits / trials, "answers": answers}
