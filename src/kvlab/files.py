"""kvlab's one atomic writer: results, reports, checkpoints and caches are never left half written.

`write_atomic` writes a file, `write_directory` a folder (a checkpoint, a draft, an export).

Every file kvlab writes that a later run reads (a study's stage results, an evaluation's cells,
a benchmark's JSON, a report's README, a training checkpoint, a KVQuant calibration) goes to a
temporary file beside its target and is renamed over it, so a kill mid-write leaves the old file
or the new one, never a torn one that a resumed run would trip on. Standard library only, so
every layer (plan aside, which writes nothing) may use it.
"""

from __future__ import annotations

import json
import os
import shutil
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


def write_directory(path: Union[str, Path], fill: Callable[[Path], None]) -> Path:
    """`fill(staging)` writes a folder beside `path`, which then replaces `path` by renames.

    A kill mid-way leaves the old folder (or none), never a half-written one; an old folder is moved
    aside before the new one takes its name and removed last, and put back if that rename fails. The
    staging folder gets the umask's permissions (mkdtemp's 0700 would hide a model from a server run
    as another user) and is removed if `fill` fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
        fill(staging)
        if not path.exists():
            os.replace(staging, path)
            return path
        aside = Path(f"{staging}.old")
        os.replace(path, aside)
        try:
            os.replace(staging, path)
        except BaseException:
            os.replace(aside, path)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
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
