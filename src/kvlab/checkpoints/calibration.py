"""Calibration text for conversions that keep the model: which tokens the fits see, and from where.

An aligned KV-head merge and an activation-aware MLA conversion fit their maps on the
activations a model produces on real text (kvlab.checkpoints.layerwise). The text must not be
the text the result is then evaluated on, or the fit would be graded on its own training
data: reports/real-models evaluates on *Frankenstein*, so the default calibration text is the
shared *Pride and Prejudice*, and `disjoint` is how a report checks that the two share no
passage. The tokens are cut into equal windows (positions 0..window-1 each), from the start
of the text: a calibration is a pure function of (text, tokens, window).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvlab.plan.errors import PlanError

DEFAULT_TEXT = ("data", "english", "pride-and-prejudice.txt")  # under the shared folder
DEFAULT_TOKENS, DEFAULT_WINDOW = 16384, 512


@dataclass(frozen=True)
class Calibration:
    """`windows` [n, window] token ids of one text, with what a report needs to name it."""

    windows: torch.Tensor
    source: str
    sha256: str

    @property
    def tokens(self) -> int:
        return self.windows.numel()

    def describe(self) -> dict:
        return {"text": self.source, "sha256": self.sha256, "tokens": self.tokens,
                "window": int(self.windows.shape[1])}


def default_text() -> Optional[Path]:
    """The shared *Pride and Prejudice*, when the shared folder is there."""
    from kvlab.checkpoints.resolve import shared_dirs

    for directory in shared_dirs():
        path = directory.joinpath(*DEFAULT_TEXT)
        if path.is_file():
            return path
    return None


def load_calibration(tokenizer, path: Optional[str | Path], tokens: int = DEFAULT_TOKENS,
                     window: int = DEFAULT_WINDOW) -> Calibration:
    """The first `tokens` tokens of `path` (default: `default_text()`) in windows of `window`.

    One-line PlanErrors for a missing or unreadable file, a model without a tokenizer, a text
    too short for one window, and sizes that are not positive.
    """
    if tokens <= 0 or window <= 1:
        raise PlanError(f"--calibration-tokens must be positive and the window above 1, got {tokens} and {window}")
    if path is None:
        path = default_text()
        if path is None:
            raise PlanError("no calibration text: pass --calibration FILE (any UTF-8 text the model will not be "
                            "evaluated on); the default, ../shared/" + "/".join(DEFAULT_TEXT) + ", is not there")
    path = Path(path)
    if tokenizer is None:
        raise PlanError("calibration needs the model's tokenizer, and this checkpoint has none")
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except OSError as error:
        raise PlanError(f"cannot read the calibration text {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise PlanError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    ids = tokenizer.encode(text, add_bos=False)
    window = min(window, tokens)
    count = min(tokens, len(ids)) // window
    if count == 0:
        raise PlanError(f"{path} holds {len(ids):,} tokens, fewer than one {window}-token calibration window")
    windows = torch.tensor(ids[: count * window], dtype=torch.long).view(count, window)
    return Calibration(windows, str(path), hashlib.sha256(raw).hexdigest())


def disjoint(a: Sequence[int], b: Sequence[int], span: int = 32) -> bool:
    """Whether no run of `span` consecutive tokens occurs in both `a` and `b` (a shared passage)."""
    seen = {tuple(a[i:i + span]) for i in range(len(a) - span + 1)}
    return not any(tuple(b[i:i + span]) in seen for i in range(len(b) - span + 1))
