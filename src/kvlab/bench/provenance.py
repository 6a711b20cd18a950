"""Where a measured number came from: versions, machine, commit and time, stored with it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


def git_state() -> tuple[Optional[str], list[str]]:
    """HEAD's commit and the tracked files that differ from it, or (None, []) outside a checkout.

    "+dirty" alone cannot tell a result measured with edited kernels from one measured while a
    report's README was being edited; the list of files can.
    """
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None, []
    return commit, sorted(line[3:] for line in status.splitlines() if line.strip())


def git_commit() -> Optional[str]:
    """The repository's HEAD (with "+dirty" when tracked files differ), or None outside a checkout."""
    commit, dirty = git_state()
    return None if commit is None else commit + ("+dirty" if dirty else "")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(threads: Optional[int] = None) -> dict:
    """Versions, machine and commit for a result's JSON."""
    import torch

    from kvlab import __version__
    info = {
        "kvlab_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": threads or torch.get_num_threads(),
                    "platform": platform.platform()},
        "git_commit": git_commit(),
        "git_dirty_files": git_state()[1],
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    kernels = sys.modules.get("kvlab.nn.kernels")  # only where this run used kvlab's kernels (no build here)
    if kernels is not None:
        try:
            info["machine"]["kernel_isa"] = kernels.kernel_isa()  # AVX2 or AVX-512 VNNI products
            info["machine"]["fp8_attention_isa"] = kernels.fp8_attention_isa()  # AVX2 loop or its AVX-512 unit
        except Exception:  # noqa: BLE001 - a build error is the benchmark's to report, not the provenance's
            pass
    try:
        import transformers
        info["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    return info
