"""Two lm-evaluation-harness tasks built locally from the ../shared novels: nothing comes from a hub.

- `kvlab_novel_cloze` (multiple choice, scored by log-likelihood): a passage from Frankenstein
  or Pride and Prejudice whose last sentence lost its last word, and four candidate words: the
  true one and three other sentences' last words. lm-eval scores each choice by the summed
  log-probability of " word" after the passage, which a served model gives it through echo
  and prompt log-probabilities; acc is the share of passages where the true word scores best.
- `kvlab_passkey` (generation): a pass key of five digits hidden at a random depth of a few
  hundred tokens of novel text, asked for at the end (Mohtashami & Jaggi's passkey retrieval);
  greedy generation until "\\n" or ".", the first number in the answer must be the key.

Each task is a YAML file over a local JSON-lines file (lm-eval's `dataset_path: json` with
`data_files`), written with `write_tasks(DIR)`; `lm_eval --include_path DIR --tasks ...` runs
them. The same seed gives the same items, byte for byte.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Optional

NOVELS = ("frankenstein.txt", "pride-and-prejudice.txt")
CLOZE_TASK, PASSKEY_TASK = "kvlab_novel_cloze", "kvlab_passkey"

CLOZE_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

PASSKEY_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{passkey}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: first-number
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def novel_texts(shared: Path) -> list[str]:
    """The two novels' text, paragraphs joined with single spaces (line breaks inside paragraphs removed)."""
    texts = []
    for name in NOVELS:
        raw = (shared / "data" / "english" / name).read_text(encoding="utf-8")
        texts.append(re.sub(r"\s+", " ", raw).strip())
    return texts


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def cloze_items(texts: list[str], count: int, seed: int = 0) -> list[dict]:
    """`count` passages ending in a sentence of 8-30 words whose last word (4+ letters) is to be chosen."""
    rng = random.Random(seed)
    candidates = []
    for text in texts:
        sents = sentences(text)
        for i in range(2, len(sents)):
            words = sents[i].split()
            if not 8 <= len(words) <= 30:
                continue
            match = re.fullmatch(r"([A-Za-z]{4,})([.!?])", words[-1])
            if match is None:
                continue
            context = " ".join(sents[i - 2:i] + [" ".join(words[:-1])])
            if len(context.split()) > 120 or '"' in words[-1]:
                continue
            candidates.append((context, match.group(1)))
    picked = rng.sample(candidates, count)
    pool = sorted({word for _, word in candidates})
    items = []
    for context, word in picked:
        distractors = []
        while len(distractors) < 3:
            other = rng.choice(pool)
            if other.lower() != word.lower() and other not in distractors:
                distractors.append(other)
        choices = distractors + [word]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "answer": choices.index(word)})
    return items


def passkey_items(texts: list[str], count: int, seed: int = 0, haystack_words: int = 220) -> list[dict]:
    """`count` prompts hiding a five-digit key at a random depth of `haystack_words` words of novel text."""
    rng = random.Random(seed + 1)
    words = " ".join(texts).split()
    items = []
    for _ in range(count):
        start = rng.randrange(0, len(words) - haystack_words)
        hay = words[start:start + haystack_words]
        depth = rng.randrange(0, haystack_words)
        key = str(rng.randrange(10000, 100000))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        body = " ".join(hay[:depth] + [needle] + hay[depth:])
        prompt = (f"There is a pass key hidden in the text below. Find it and remember it.\n{body}\n"
                  "What is the pass key? The pass key is")
        items.append({"prompt": prompt, "passkey": key})
    return items


def write_tasks(directory: Path, shared: Path, cloze: int = 100, passkey: int = 20, seed: int = 0,
                suffix: Optional[str] = None) -> dict:
    """Write both tasks' JSON-lines data and YAML into `directory`; returns their names and item counts."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = novel_texts(shared)
    names = {CLOZE_TASK: cloze_items(texts, cloze, seed), PASSKEY_TASK: passkey_items(texts, passkey, seed)}
    out = {}
    for task, items in names.items():
        name = task if suffix is None else f"{task}_{suffix}"
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        template = CLOZE_YAML if task == CLOZE_TASK else PASSKEY_YAML
        (directory / f"{name}.yaml").write_text(template.format(task=name, data=data.resolve()), encoding="utf-8")
        out[name] = len(items)
    return out
