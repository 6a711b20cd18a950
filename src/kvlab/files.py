"""kvlab's one atomic writer: results, reports, checkpoints and caches are never left half written.

Every file kvlab writes that a later run reads (a study's stage results, an evaluation's cells,
a benchmark's JSON, a report's README, a training checkpoint, a KVQuant calibration) goes to a
temporary file beside its target and is renamed over it, so a kill mid-write leaves the old file
or the new one, never a torn one that a resumed run would trip on. Standard library only, so
every layer (plan aside, which writes nothing) may use it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Union

Content = Union[str, bytes, Callable[[BinaryIO], None]]


def write_atomic(path: Union[str, Path], content: Content) -> Path:
    """Write `content` (text as UTF-8, bytes, or a function writing to a binary handle) to `path` atomically.

    The temporary file sits beside `path` (same file system, so the rename is atomic) and is
    removed if writing fails; the target's folder is created when missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644  # mkstemp's 0600 would hide a report
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode("utf-8") if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: Union[str, Path], obj: Any, indent: Optional[int] = 2) -> Path:
    """`obj` as JSON (`indent` spaces, a final newline), written atomically."""
    return write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def read_json(path: Union[str, Path]) -> Optional[Any]:
    """The file's object, or None when it does not exist yet."""
    path = Path(path)
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
