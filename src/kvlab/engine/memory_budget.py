"""vLLM's `--gpu-memory-utilization` as vLLM's CPU backend reads it: a fraction of the machine's memory.

On a GPU the flag is the share of the card vLLM may take, weights and activations included,
the KV cache getting what is left. vLLM's CPU worker reads it the same way over host memory:
it may use utilization x total memory, and the KV cache gets that less what the process already
holds after loading the model (its resident set). It refuses to start when that share is more
than the machine has free, or leaves nothing for the cache. kvlab does the same, so a command
line written for vLLM sizes kvlab's pool the way it sized vLLM's.
"""

from __future__ import annotations

import os

from kvlab.engine.errors import RequestError


def _meminfo_bytes(field: str, pages: str) -> int:
    """/proc/meminfo's `field` in bytes, or sysconf's page count `pages` times the page size where it is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)


def total_memory_bytes() -> int:
    """MemTotal from /proc/meminfo."""
    return _meminfo_bytes("MemTotal", "SC_PHYS_PAGES")


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the machine can give without swapping)."""
    return _meminfo_bytes("MemAvailable", "SC_AVPHYS_PAGES")


def resident_bytes() -> int:
    """This process's resident memory (VmRSS): the model's weights and everything loaded so far."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def utilization_budget(utilization: float, available: int, total: int | None = None,
                       resident: int | None = None) -> int:
    """KV cache bytes for `--gpu-memory-utilization U`: U x total memory less this process's resident set."""
    total = total_memory_bytes() if total is None else total
    resident = resident_bytes() if resident is None else resident
    wanted = int(total * utilization)
    if wanted - resident > available:
        raise RequestError(f"--gpu-memory-utilization {utilization} asks for {wanted / 2**30:.2f} GiB of this "
                           f"machine's {total / 2**30:.2f} GiB, but only {(available + resident) / 2**30:.2f} GiB "
                           "are free for kvlab; lower it (on CPUs it is the fraction of host memory kvlab may use)",
                           "gpu_memory_utilization")
    budget = wanted - resident
    if budget <= 0:
        raise RequestError(f"--gpu-memory-utilization {utilization} ({wanted / 2**30:.2f} GiB) leaves nothing for "
                           f"the KV cache once the model is loaded ({resident / 2**30:.2f} GiB resident); raise it",
                           "gpu_memory_utilization")
    return budget
