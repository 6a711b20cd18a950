"""Tiny Shakespeare at the character level: fetch once, verify, split 90/10, deterministic batches.

Batches are a pure function of (seed, step): a run resumed from step k draws exactly the
batches an uninterrupted run would have drawn, with no random-number state to save, and two
models trained with the same seed see the same data in the same order.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from kvlab.files import write_atomic
from kvlab.plan.errors import PlanError

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TRAIN_FRACTION = 0.9


class DataError(PlanError):
    """The corpus cannot be had (offline with no copy, bad checksum): one line, exit 2."""


def cache_dir() -> Path:
    """kvlab's cache folder: $KVLAB_CACHE, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab."""
    if os.environ.get("KVLAB_CACHE"):
        return Path(os.environ["KVLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlab"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_tiny_shakespeare(path: Optional[Path] = None, url: str = TINY_SHAKESPEARE_URL, timeout: float = 30.0) -> Path:
    """The cached copy at `path` (default: the cache folder), downloaded and verified if missing."""
    path = Path(path) if path is not None else cache_dir() / "tinyshakespeare.txt"
    if path.exists() and sha256_bytes(path.read_bytes()) == TINY_SHAKESPEARE_SHA256:
        return path
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise DataError(f"Tiny Shakespeare is not cached at {path} and cannot be downloaded from {url} "
                        f"({reason}); pass --data PATH to a local copy") from None
    if sha256_bytes(data) != TINY_SHAKESPEARE_SHA256:
        raise DataError(f"the download from {url} has sha256 {sha256_bytes(data)}, "
                        f"expected {TINY_SHAKESPEARE_SHA256}; not caching it")
    return write_atomic(path, data)


@dataclass(frozen=True)
class CharCorpus:
    """A text encoded one character per token, split into train (first 90%) and validation (rest)."""

    chars: str
    train: torch.Tensor
    val: torch.Tensor
    sha256: str
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def split(self, name: str) -> torch.Tensor:
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val


def load_corpus(path: Optional[str | Path] = None) -> CharCorpus:
    """Read `path` (any UTF-8 text), or the verified Tiny Shakespeare copy when None."""
    source = Path(path) if path is not None else fetch_tiny_shakespeare()
    raw = source.read_bytes()
    text = raw.decode("utf-8")
    if len(text) < 100:
        raise DataError(f"{source} holds {len(text)} characters; a character model needs more text")
    chars = "".join(sorted(set(text)))
    lookup = torch.full((max(map(ord, chars)) + 1,), -1, dtype=torch.long)
    lookup[torch.tensor([ord(c) for c in chars])] = torch.arange(len(chars))
    ids = lookup[torch.tensor([ord(c) for c in text])]
    cut = int(len(ids) * TRAIN_FRACTION)
    return CharCorpus(chars, ids[:cut].clone(), ids[cut:].clone(), sha256_bytes(raw), str(source))


def batch_generator(seed: int, step: int) -> torch.Generator:
    """The generator for one step's batch: a fixed function of (seed, step)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def random_batch(data: torch.Tensor, batch_size: int, block_size: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` windows at random offsets: inputs [B, T] and next-character targets [B, T]."""
    if len(data) <= block_size:
        raise DataError(f"a split of {len(data)} tokens is too short for a {block_size}-token context")
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    offsets = starts[:, None] + torch.arange(block_size + 1)[None]
    windows = data[offsets]
    return windows[:, :-1], windows[:, 1:]


def train_batch(corpus: CharCorpus, seed: int, step: int, batch_size: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(corpus.train, batch_size, block_size, batch_generator(seed, step))


def eval_batches(data: torch.Tensor, count: int, batch_size: int, block_size: int,
                 seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same `count` validation batches every time (periodic evaluation during training)."""
    generator = torch.Generator().manual_seed(seed)
    return [random_batch(data, batch_size, block_size, generator) for _ in range(count)]


def tiled_windows(data: torch.Tensor, block_size: int, batch_size: int,
                  max_tokens: Optional[int] = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows covering the split once (the final, full validation loss)."""
    usable = len(data) - 1 if max_tokens is None else min(len(data) - 1, max_tokens)
    count = usable // block_size
    if count == 0:
        raise DataError(f"a split of {len(data)} tokens is too short for a {block_size}-token context")
    x = data[: count * block_size].view(count, block_size)
    y = data[1: count * block_size + 1].view(count, block_size)
    for start in range(0, count, batch_size):
        yield x[start:start + batch_size], y[start:start + batch_size]
