"""The results file: one JSON object of finished cells, rewritten atomically after each one.

A cell is one (setting, task, parameters) measurement under a stable key. Re-running the same
command reads the file and skips every key already there, so an interrupted sweep resumes
where it stopped and a report can be produced in several shorter runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from kvlab.evals.setting import EvalError


class ResultStore:
    """Finished cells by key, plus the provenance of every run that added some."""

    def __init__(self, path: Optional[Path], header: dict[str, Any]) -> None:
        self.path = Path(path) if path is not None else None
        self.data: dict[str, Any] = {"kind": "kvlab-eval", **header, "runs": [], "cells": {}}
        if self.path is not None and self.path.exists():
            try:
                old = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                raise EvalError(f"{self.path} is not a kvlab eval results file ({error}); move it or pick --out")
            if old.get("kind") != "kvlab-eval" or not isinstance(old.get("cells"), dict):
                raise EvalError(f"{self.path} is not a kvlab eval results file; move it or pick another --out")
            if old.get("model") != header.get("model"):
                raise EvalError(f"{self.path} holds results for {old.get('model')!r}, not {header.get('model')!r}")
            if old.get("weights", "dense") != header.get("weights", "dense"):  # older files: dense weights
                raise EvalError(f"{self.path} holds results on {old.get('weights', 'dense')} weights, not "
                                f"{header.get('weights', 'dense')}; pick another --out")
            self.data["runs"], self.data["cells"] = old.get("runs", []), old["cells"]

    def has(self, key: str) -> bool:
        return key in self.data["cells"]

    def get(self, key: str) -> Optional[dict]:
        return self.data["cells"].get(key)

    def add_run(self, provenance: dict) -> None:
        self.data["runs"].append(provenance)

    def put(self, key: str, cell: dict) -> None:
        self.data["cells"][key] = cell
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        from kvlab.files import write_json

        write_json(self.path, self.data, indent=1)
