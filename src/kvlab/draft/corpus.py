"""The distillation corpus: the target's own answers, with its top log-probabilities at every token.

DistillSpec (Zhou et al., 2023) trains the draft on text the target generates, where the
draft will later be asked to guess; the target's log-probabilities at each generated token
are the soft labels. The full distribution over 49,152 tokens is too big to keep for every
token, so each position keeps the target's top TOP_K (the engine's `logprobs`, of the raw
distribution), which hold nearly all of its mass on this kind of text; the rest of the mass
is one remainder bucket (kvlab.draft.distill).

Generation goes through kvlab's engine (continuous batching, the C decode step), once: the
corpus is written shard by shard, each shard atomically, into a folder named by everything
that decides its content, and a later run (or a run killed half way) reuses what exists.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from kvlab.draft.prompts import WORKLOADS, questions, split
from kvlab.plan.errors import PlanError
from kvlab.train.loop import save_atomic

TOP_K = 20  # the engine's largest `logprobs`
SHARD_FORMAT = "kvlab-draft-corpus-1"


@dataclass(frozen=True)
class CorpusConfig:
    """What the corpus holds: which prompts, at which temperatures, how long each answer is."""

    teacher: str = "smollm2-135m"
    num_shards: int = 24
    shard_size: int = 32  # requests per shard (one engine batch)
    max_tokens: int = 128  # answer tokens per request
    max_prompt_tokens: int = 256
    temperatures: tuple = (0.0, 0.8)  # alternating per request: greedy answers and sampled ones
    predictable_every: int = 3  # one request in three is a predictable-text one
    prompt_source: str = "auto"  # "auto": ShareGPT when installed; "builtin": the built-in questions
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Request:
    workload: str
    question: str
    temperature: float
    seed: int


def requests(config: CorpusConfig, chat: list[str], predictable: list[str]) -> list[Request]:
    """Every request of the corpus in shard order: training prompts only, cycling where they run out."""
    out = []
    counts = {"chat": 0, "predictable": 0}
    for i in range(config.num_shards * config.shard_size):
        workload = "predictable" if i % config.predictable_every == config.predictable_every - 1 else "chat"
        pool = predictable if workload == "predictable" else chat
        n = counts[workload]
        counts[workload] += 1
        temperature = config.temperatures[i % len(config.temperatures)]
        out.append(Request(workload, pool[n % len(pool)], temperature, config.seed * 1_000_003 + i))
    return out


def chat_ids(tokenizer, question: str) -> list[int]:
    """A question in the model's chat template, encoded as `LLM.chat` encodes it."""
    if not tokenizer.chat_template:  # a base model (stories260K in tests): the question as plain text
        return tokenizer.encode(question)
    text = tokenizer.render_chat([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_bos=False if tokenizer.bos_id is None else None)


def corpus_dir(config: CorpusConfig, root: Optional[Path] = None) -> Path:
    from kvlab.train.data import cache_dir
    return Path(root) if root is not None else cache_dir() / "draft-corpus" / config.key()


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:04d}.pt"


def build_corpus(config: CorpusConfig, directory: Path, llm=None, max_seconds: Optional[float] = None,
                 log: Callable[[str], None] = lambda line: None, progress: bool = True) -> dict:
    """Generate the shards `directory` lacks (stopping after `max_seconds`); the manifest of what exists."""
    directory.mkdir(parents=True, exist_ok=True)
    missing = [i for i in range(config.num_shards) if not shard_path(directory, i).exists()]
    started = time.monotonic()
    if missing:
        from kvlab.engine.sampling import SamplingParams
        from kvlab.train.progress import progress_bar

        if llm is None:
            from kvlab.engine.llm import LLM
            llm = LLM(config.teacher, kv_cache_memory=256 << 20, max_num_seqs=config.shard_size)
        tokenizer = llm.engine.tokenizer
        chat, chat_source = questions("chat", source=config.prompt_source)
        predictable, _ = questions("predictable")
        chat, predictable = split(chat, held_out=False), split(predictable, held_out=False)
        todo = requests(config, chat, predictable)
        log(f"corpus: {len(missing)} of {config.num_shards} shards to generate ({chat_source}) into {directory}")
        bar = progress_bar(len(missing), "teacher text", unit="shard", enabled=progress)
        for index in missing:
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                log("corpus: time budget spent; run again to continue")
                break
            batch = todo[index * config.shard_size:(index + 1) * config.shard_size]
            prompts = [chat_ids(tokenizer, r.question)[-config.max_prompt_tokens:] for r in batch]
            params = [SamplingParams(temperature=r.temperature, max_tokens=config.max_tokens, seed=r.seed,
                                     logprobs=TOP_K) for r in batch]
            outputs = llm.generate(prompts, params)
            records = []
            for request, prompt, output in zip(batch, prompts, outputs):
                completion = output.outputs[0]
                logprobs = completion.logprobs or []
                records.append({
                    "workload": request.workload, "temperature": request.temperature,
                    "prompt_ids": torch.tensor(prompt, dtype=torch.int32),
                    "output_ids": torch.tensor(completion.token_ids, dtype=torch.int32),
                    "top_ids": torch.tensor([[t for t, _ in s.top_logprobs] for s in logprobs], dtype=torch.int32),
                    "top_logprobs": torch.tensor([[v for _, v in s.top_logprobs] for s in logprobs],
                                                 dtype=torch.float32),
                })
            save_atomic({"format": SHARD_FORMAT, "config": asdict(config), "records": records},
                              shard_path(directory, index))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    return manifest(config, directory)


def manifest(config: CorpusConfig, directory: Path) -> dict:
    present = [i for i in range(config.num_shards) if shard_path(directory, i).exists()]
    return {"directory": str(directory), "config": asdict(config), "shards_present": len(present),
            "shards_total": config.num_shards, "complete": len(present) == config.num_shards}


def load_records(config: CorpusConfig, directory: Path) -> list[dict]:
    """Every record of the corpus's present shards, in shard order."""
    out = []
    for i in range(config.num_shards):
        path = shard_path(directory, i)
        if not path.exists():
            continue
        shard = torch.load(path, map_location="cpu", weights_only=False)
        if shard.get("format") != SHARD_FORMAT:
            raise PlanError(f"{path} is not a kvlab draft-corpus shard")
        out += shard["records"]
    if not out:
        raise PlanError(f"the corpus in {directory} has no shards yet: run `kvlab draft corpus` first")
    return out


__all__ = ["CorpusConfig", "WORKLOADS", "build_corpus", "load_records", "corpus_dir", "manifest", "chat_ids"]
