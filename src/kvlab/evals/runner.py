"""Sweeps of cells for one setting: skip what the results file holds, measure the rest, save each.

Everything a cell depends on is in its key (setting label, task, text, sizes, seed, chunk), so a
changed parameter is a new cell, never a stale hit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvlab.evals.calibrate import text_ids
from kvlab.evals.passkey import run_cell
from kvlab.evals.perplexity import perplexity, text_windows
from kvlab.evals.setting import EvalError, KVSetting, build_model, new_cache
from kvlab.evals.store import ResultStore

Progress = Callable[[int], None]  # called with units just finished (windows, trials)


@dataclass(frozen=True)
class PerplexityTask:
    text: Path
    context: int = 1024
    windows: int = 1
    chunk: int = 128
    offset: int = 0  # tokens of the text skipped first (its title page and contents)

    def key(self, setting: KVSetting) -> str:
        return (f"{setting.label} | perplexity | {self.text.name} | ctx{self.context} x{self.windows} "
                f"chunk{self.chunk} offset{self.offset}")


@dataclass(frozen=True)
class PasskeyTask:
    lengths: Sequence[int] = (512, 1024, 2048)
    depths: Sequence[float] = (0.1, 0.5, 0.9)
    trials: int = 10
    seed: int = 0
    chunk: int = 256

    def key(self, setting: KVSetting, length: int, depth: float) -> str:
        return (f"{setting.label} | passkey | len{length} depth{depth:.2f} | trials{self.trials} seed{self.seed} "
                f"chunk{self.chunk}")

    def cells(self) -> list[tuple[int, float]]:
        return [(length, depth) for length in self.lengths for depth in self.depths]


@dataclass
class Evaluator:
    """One loaded model (with its tokenizer), evaluated under settings into one results store."""

    loaded: object
    store: ResultStore
    calibration: Callable[[KVSetting, object], object] = lambda setting, model: None
    on_progress: Progress = lambda n: None
    text_cache: dict = field(default_factory=dict)

    def pending(self, setting: KVSetting, task) -> int:
        """Units (windows or trials) still to measure for `task` under `setting`."""
        if isinstance(task, PerplexityTask):
            return 0 if self.store.has(task.key(setting)) else task.windows
        return sum(task.trials for length, depth in task.cells() if not self.store.has(task.key(setting, length, depth)))

    def perplexity(self, setting: KVSetting, task: PerplexityTask) -> dict:
        key = task.key(setting)
        if self.store.has(key):
            return self.store.get(key)
        model = build_model(self.loaded, setting)
        calibration = self.calibration(setting, model)
        tokenizer = self.tokenizer()
        windows = text_windows(self.text_ids(task.text)[task.offset:], task.context, task.windows,
                               tokenizer.bos_id if tokenizer.add_bos else None)
        started = time.perf_counter()
        result = perplexity(model, windows, lambda n: new_cache(model, setting, n, calibration), task.chunk,
                            on_window=lambda *_: self.on_progress(1))
        cell = {"setting": setting.as_dict(), "label": setting.label, "task": "perplexity", "text": task.text.name,
                "context": task.context, "windows": task.windows, "chunk": task.chunk, "offset": task.offset,
                **result, "seconds": round(time.perf_counter() - started, 2)}
        self.store.put(key, cell)
        return cell

    def passkey(self, setting: KVSetting, task: PasskeyTask) -> list[dict]:
        cells, model, calibration = [], None, None
        for length, depth in task.cells():
            key = task.key(setting, length, depth)
            if not self.store.has(key):
                if model is None:
                    model = build_model(self.loaded, setting)
                    calibration = self.calibration(setting, model)
                started = time.perf_counter()
                result = run_cell(model, self.tokenizer(), lambda n: new_cache(model, setting, n, calibration),
                                  length, depth, task.trials, task.seed, task.chunk,
                                  on_trial=lambda: self.on_progress(1))
                self.store.put(key, {"setting": setting.as_dict(), "label": setting.label, "task": "passkey",
                                     "seed": task.seed, "chunk": task.chunk, **result,
                                     "seconds": round(time.perf_counter() - started, 2)})
            cells.append(self.store.get(key))
        return cells

    def tokenizer(self):
        if self.loaded.tokenizer is None:
            raise EvalError(f"{self.loaded.path} has no tokenizer: evals need text")
        return self.loaded.tokenizer

    def text_ids(self, path: Path) -> list[int]:
        if path not in self.text_cache:
            self.text_cache[path] = text_ids(self.tokenizer(), path)
        return self.text_cache[path]
