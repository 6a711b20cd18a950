"""Where a measured number came from: versions, machine, commit and time, stored with it.

kvlab's one provenance record. Every benchmark, study, evaluation and report JSON stores
`provenance()` under "provenance", so one reader (kvlab.report's renderers) understands all of
them. Its keys: kvlab_version, torch_version, python_version (transformers_version when
installed), machine {cpu, cores, torch_threads, platform, memory_bytes, kernel ISAs when kvlab's
kernels ran}, git_commit ("+dirty" when tracked files differ), git_dirty_files, command,
time_utc and load_average (1, 5 and 15 minutes: more than the run's own threads means it shared
the machine). The GQA study wrote its own schema before this one; gqa_report reads both.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


def git_state(root: Optional[str] = None) -> tuple[Optional[str], list[str]]:
    """HEAD's commit and the tracked files that differ from it, or (None, []) outside a checkout.

    "+dirty" alone cannot tell a result measured with edited kernels from one measured while a
    report's README was being edited; the list of files can. `root`: another checkout (default:
    the one kvlab is imported from).
    """
    root = root or Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None, []
    return commit, sorted(line[3:] for line in status.splitlines() if line.strip())


def git_commit(state: Optional[tuple[Optional[str], list[str]]] = None) -> Optional[str]:
    """The repository's HEAD (with "+dirty" when tracked files differ), or None outside a checkout."""
    commit, dirty = state or git_state()
    return None if commit is None else commit + ("+dirty" if dirty else "")


def memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def load_average() -> Optional[list[float]]:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(threads: Optional[int] = None, git: Optional[tuple[Optional[str], list[str]]] = None) -> dict:
    """Versions, machine and commit for a result's JSON (the one schema: see the module's docstring).

    `git`: a `git_state()` taken earlier, when a long run (a study) should record the code it
    imported at its start rather than what the tree holds when it finishes.
    """
    import torch

    from kvlab import __version__
    state = git or git_state()
    info = {
        "kvlab_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": threads or torch.get_num_threads(),
                    "platform": platform.platform(), "memory_bytes": memory_bytes()},
        "git_commit": git_commit(state),
        "git_dirty_files": state[1],
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": load_average(),
    }
    kernels = sys.modules.get("kvlab.nn.kernels")  # only where this run used kvlab's kernels (no build here)
    if kernels is not None:
        try:
            info["machine"]["kernel_isa"] = kernels.kernel_isa()  # AVX2 or AVX-512 VNNI products
            info["machine"]["fp8_attention_isa"] = kernels.fp8_attention_isa()  # AVX2 loop or its AVX-512 unit
        except Exception:  # noqa: BLE001 - a build error is the benchmark's to report, not the provenance's
            pass
    threads_module = sys.modules.get("kvlab.nn.threads")  # how steps chose their threads (kvlab.nn.threads)
    if threads_module is not None:
        info["machine"]["thread_policy"] = "adaptive" if threads_module.governed() else "fixed"
    backend_module = sys.modules.get("kvlab.nn.matmul_backend")  # where products of many rows ran
    if backend_module is not None:
        info["machine"]["matmul_backend"] = backend_module.backend()
        info["machine"]["library_dtype"] = str(backend_module.library_dtype()).removeprefix("torch.")
        info["machine"]["crossovers"] = backend_module.known_crossovers()
    try:
        import transformers
        info["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    return info
