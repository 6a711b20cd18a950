"""Where a result came from: code version, library versions, machine, and how busy it was."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

import kvlab


def repo_root() -> Optional[Path]:
    root = Path(kvlab.__file__).resolve().parents[2]
    return root if (root / ".git").exists() else None


def git_info() -> dict:
    """HEAD's commit and which tracked files under src/ differ from it (None outside a git checkout).

    Call it when the code is imported (a study's start): files edited later do not affect a running process.
    """
    root = repo_root()
    if root is None:
        return {"commit": None, "dirty": None}

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD") or None
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no", "--", "src").splitlines()]
    return {"commit": commit, "dirty_src": bool(changed), "changed_files": changed}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def versions() -> dict:
    out = {"python": sys.version.split()[0], "kvlab": kvlab.__version__}
    for name in ("torch", "numpy", "matplotlib"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "memory_bytes": memory_bytes()}


def load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
