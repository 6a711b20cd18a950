"""Benchmark results on disk: written to a temporary file beside the target, then renamed, so an
interrupted run never leaves a half-written JSON where a finished one was."""

from __future__ import annotations

import json
import os


def write_json(path: str, data: dict) -> None:
    """Atomically: a temp file beside `path`, then a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    with open(temp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(temp, path)
