"""Collect KVQuant's calibration activations from a model and fit its codebooks (kvlab calibrate-kv).

The model runs on calibration text with a capturing cache that sees exactly what a KVQuant
cache would store: keys before RoPE, values, per layer. With `sensitivity`, the loss is
backpropagated and each cached value weighted by its squared gradient (the Fisher
information's diagonal, KVQuant's sensitivity weighting); without, every value counts alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.cache.kvquant_calibration import BITS, KVQuantCalibration, fit_layer
from kvlab.evals.setting import EvalError
from kvlab.plan.kv_formats import DEFAULT_OUTLIER_PERCENT, DEFAULT_SINK_TOKENS


class CaptureCache:
    """Stands in for a cache for one full-window forward: records pre-RoPE keys and values."""

    pre_rope = True

    def __init__(self, num_layers: int, ropes: Sequence[Callable[[Tensor, Tensor], Tensor]], keep_grad: bool) -> None:
        self.ropes, self.keep_grad = ropes, keep_grad  # each layer's rotation
        self.k: list[Optional[Tensor]] = [None] * num_layers
        self.v: list[Optional[Tensor]] = [None] * num_layers

    def seq_len(self, layer_idx: int = 0) -> int:
        return 0

    def window_mask(self, layer: int, new_tokens: int):
        return None

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.keep_grad:
            k.retain_grad()
            v.retain_grad()
        self.k[layer], self.v[layer] = k, v
        return self.ropes[layer](k, torch.arange(k.shape[2], device=k.device)), v


def calibration_windows(ids: list[int], context: int, windows: int) -> list[list[int]]:
    if len(ids) < context * windows:
        raise EvalError(f"the calibration text has {len(ids):,} tokens, fewer than {windows} x {context}")
    return [ids[i * context:(i + 1) * context] for i in range(windows)]


def calibration_ids(sources: dict[str, list[int]], context: int, windows: int) -> list[int]:
    """The tokens of `windows` calibration windows of `context` tokens shared out among several texts
    (name -> token ids), in order, each text giving its first windows and every text at least one, so
    that a calibration can mix kinds of text (say a novel and one's own traffic) and no window
    straddles two of them. `calibrate(model, calibration_ids(...), context, windows)` reads them."""
    if windows < len(sources):
        raise EvalError(f"--windows {windows} is fewer than the {len(sources)} calibration texts: each needs one")
    out: list[int] = []
    for index, (name, ids) in enumerate(sources.items()):
        share = windows // len(sources) + (index < windows % len(sources))
        if len(ids) < share * context:
            raise EvalError(f"the calibration text {name} has {len(ids):,} tokens, fewer than its {share} x {context}")
        out += ids[:share * context]
    return out


def collect(model, windows: list[list[int]], sensitivity: bool,
            on_window: Callable[[], None] = lambda: None) -> list[tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]]:
    """Per layer: keys, values [H, N, D] over every window's tokens, and their squared gradients."""
    layers = model.config.n_layers
    ks, vs, kgs, vgs = ([[] for _ in range(layers)] for _ in range(4))
    embed = model.embed.weight
    was = embed.requires_grad
    try:
        for window in windows:
            ids = torch.tensor([window], dtype=torch.long)
            capture = CaptureCache(layers, model.layer_ropes(), sensitivity)
            if sensitivity:
                embed.requires_grad_(True)  # so every activation has a graph back to the input
                with torch.enable_grad():
                    logits = model(ids[:, :-1], cache=capture)
                    F.cross_entropy(logits[0].float(), ids[0, 1:]).backward()
                model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    model(ids[:, :-1], cache=capture)
            for i in range(layers):
                ks[i].append(capture.k[i][0].detach())
                vs[i].append(capture.v[i][0].detach())
                if sensitivity:
                    kgs[i].append(capture.k[i].grad[0] ** 2)
                    vgs[i].append(capture.v[i].grad[0] ** 2)
            on_window()
    finally:
        embed.requires_grad_(was)
    return [(torch.cat(ks[i], 1), torch.cat(vs[i], 1), torch.cat(kgs[i], 1) if sensitivity else None,
             torch.cat(vgs[i], 1) if sensitivity else None) for i in range(layers)]


def without_sinks(x: Optional[Tensor], window: int, sink_tokens: int) -> Optional[Tensor]:
    """Activations [H, N, D] of consecutive windows of `window` tokens less each window's first
    `sink_tokens` (the cache keeps those in fp16, so they must not shape the ranges or codebooks)."""
    if x is None or sink_tokens == 0:
        return x
    keep = torch.arange(x.shape[1], device=x.device) % window >= sink_tokens
    return x[:, keep]


def calibrate(model, ids: list[int], context: int = 512, windows: int = 4, sensitivity: bool = True,
              outlier_percent: int = DEFAULT_OUTLIER_PERCENT, bits: tuple[int, ...] = BITS,
              on_window: Callable[[], None] = lambda: None, meta: Optional[dict] = None,
              sink_tokens: int = DEFAULT_SINK_TOKENS) -> KVQuantCalibration:
    """Fit every layer's codebooks (for each of `bits`) and key channel ranges."""
    samples = collect(model.eval(), calibration_windows(ids, context, windows), sensitivity, on_window)
    fed = context - 1  # each window feeds all but its last token (the last is only a target)
    layers = [fit_layer(*(without_sinks(x, fed, sink_tokens) for x in sample), bits, outlier_percent)
              for sample in samples]
    info = {"context": context, "windows": windows, "sensitivity_weighted": sensitivity,
            "outlier_percent": outlier_percent, "sink_tokens": sink_tokens, **(meta or {})}
    return KVQuantCalibration(model.config.kv_heads, model.config.head_size, layers, info)


def text_ids(tokenizer, path: Path) -> list[int]:
    """A UTF-8 text file's tokens (EvalError, a one-line user error, for one that is not UTF-8)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise EvalError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    return tokenizer.encode(text, add_bos=False)
