"""This machine's memory bandwidth, measured once with a torch copy and remembered.

Decode at batch 1 reads every weight once per token, so bytes / bandwidth is its floor
(kvlab.plan.roofline); `kvlab measure` reports how close a real run gets to that floor.
A copy of a buffer far larger than the last-level cache reads and writes each byte once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from kvlab.files import write_json

CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlab" / "bandwidth.json"
BUFFER_BYTES = 256 * 2**20  # far beyond any CPU's last-level cache
REPEATS = 7


def measure_bandwidth_gbs(buffer_bytes: int = BUFFER_BYTES, repeats: int = REPEATS) -> float:
    """Best-of-`repeats` copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import torch

    source = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best / 1e9


def machine_bandwidth_gbs(refresh: bool = False, cache_file: Optional[Path] = None) -> tuple[float, str]:
    """(GB/s, where it came from): the remembered figure, or a fresh measurement saved for next time."""
    import torch

    path = Path(cache_file or CACHE_FILE)
    key = f"threads={torch.get_num_threads()}"
    known = {}
    if path.is_file():
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
    if not refresh and isinstance(known.get(key), dict) and known[key].get("gbs", 0) > 0:
        return float(known[key]["gbs"]), f"measured {known[key].get('time_utc', '')} ({path})"
    gbs = measure_bandwidth_gbs()
    known[key] = {"gbs": round(gbs, 2), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "method": f"torch copy of {BUFFER_BYTES >> 20} MiB, best of {REPEATS}"}
    try:
        write_json(path, known)
    except OSError:
        pass  # a read-only home still gets the figure, just not remembered
    return gbs, "measured now"
