"""Which backend multiplies a GGUF matrix by a batch of rows: kvlab's C kernels or the library.

The C kernels read the 4-bit blocks directly: at one row (a decode step) a product is
bandwidth-bound and they are the fastest thing on every machine this project ran on. At many
rows (a prompt chunk, a verification, a large batch) a product is compute-bound, and there
oneDNN, through torch's `F.linear`, wins where the CPU has matrix engines: on a Xeon with AMX a
bf16 576 x 1536 product of 128 rows ran at 1.5 TFLOP/s (issue 36). On an AVX2-only CPU bf16
has no hardware path and the kernels match fp32 GEMM even at 2,048 rows. So the answer is
per machine: `crossover()` measures, once per machine and matrix shape, the smallest row count
from which the library is faster, and remembers it (~/.cache/kvlab/crossover.json, as the
bandwidth probe does). A matrix's library copy (bf16 where the CPU has AVX-512 BF16 or AMX,
else fp32) is made the first time a product takes the library path and kept: 2 bytes per
weight in bf16 (270 MB for SmolLM2-135M), 4 in fp32.

`KVLAB_MATMUL_BACKEND` (or `kvlab serve --matmul-backend`) overrides: `kernels` (never the
library), `library` (from 2 rows on: tests and comparisons), `auto` (the measured crossover;
the default). Tests run `kernels` unless they ask (tests/conftest.py): a crossover is timed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
from torch.nn import functional as F

from kvlab.files import write_json

BACKENDS = ("auto", "kernels", "library")
ROWS = (2, 4, 8, 16, 32, 64, 128, 256)  # the row counts a crossover is measured at
REPEATS = 3  # timed products per (backend, rows): the best counts
NEVER = 1 << 30  # the crossover of a shape where the library never won
CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlab" / "crossover.json"
_MEASURED: dict[str, int] = {}  # this process's crossovers, by key


def backend() -> str:
    """The backend setting in force: KVLAB_MATMUL_BACKEND, default auto."""
    value = os.environ.get("KVLAB_MATMUL_BACKEND", "auto")
    if value not in BACKENDS:
        raise ValueError(f"KVLAB_MATMUL_BACKEND is one of {', '.join(BACKENDS)}, not {value!r}")
    return value


def set_backend(value: str) -> None:
    """Choose the backend for this process (and the processes it starts)."""
    if value not in BACKENDS:
        raise ValueError(f"the matmul backend is one of {', '.join(BACKENDS)}, not {value!r}")
    os.environ["KVLAB_MATMUL_BACKEND"] = value


def _cpuinfo(field: str) -> str:
    """The first `field` line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def library_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies it in hardware (AVX-512 BF16, AMX), else fp32."""
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & _cpu_flags() else torch.float32


def library_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] fp32 times the library copy [out, in]: fp32 [rows, out]."""
    return F.linear(x.to(weight.dtype), weight).to(torch.float32)


def _key(layer) -> str:
    """The machine, library and shape a crossover belongs to. Not the thread count: the thread
    governor (kvlab.nn.threads) runs some steps on one thread, and a step must never stop to
    measure; a measurement records the threads it ran on."""
    dtype = str(library_dtype()).removeprefix("torch.")
    return (f"{_cpuinfo('model name')}|torch {torch.__version__}|{dtype}|"
            f"{layer.kind}/{layer.activations} {layer.out_features}x{layer.in_features}")


def _best(fn, repeats: int = REPEATS) -> float:
    fn()  # warm: buffers, the library's kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(layer) -> dict:
    """The kernels' and the library's time per row count for one GGMLLinear, and the crossover."""
    weight = layer.library_weight()
    times = {}
    for rows in ROWS:
        x = torch.randn(rows, layer.in_features)
        times[rows] = (_best(lambda: layer.kernel_product(x)), _best(lambda: library_product(x, weight)))
    winning = [rows for rows in ROWS if times[rows][1] < times[rows][0]]
    # the smallest row count from which the library wins at every larger count measured
    crossover = next((r for r in ROWS if all(s in winning for s in ROWS if s >= r)), NEVER)
    return {"crossover": crossover, "threads": torch.get_num_threads(),
            "seconds": {str(r): list(t) for r, t in times.items()}}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def crossover(layer, cache_file: Optional[Path] = None) -> int:
    """The row count from which `layer`'s products go to the library on this machine (NEVER: not at all)."""
    key = _key(layer)
    if key in _MEASURED:
        return _MEASURED[key]
    path = Path(cache_file or CACHE_FILE)
    known = _load(path)
    if isinstance(known.get(key), dict) and "crossover" in known[key]:
        _MEASURED[key] = int(known[key]["crossover"])
        return _MEASURED[key]
    return remember(layer, measure(layer), path)


def remember(layer, figures: dict, cache_file: Optional[Path] = None) -> int:
    """Keep a measurement of `layer` (`measure`) for this process and the next; its crossover."""
    key, path = _key(layer), Path(cache_file or CACHE_FILE)
    figures = {**figures, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    known = _load(path)
    known[key] = figures
    try:
        write_json(path, known)
    except OSError:
        pass  # a read-only home still gets the figure, just not remembered
    _MEASURED[key] = int(figures["crossover"])
    return _MEASURED[key]


def uses_library(layer, rows: int) -> bool:
    """Whether a product of `rows` rows on `layer` goes to the library (module doc)."""
    if rows < 2:
        return False
    setting = backend()
    if setting == "kernels":
        return False
    if setting == "library":
        return True
    return rows >= min(ROWS) and rows >= crossover(layer)


def known_crossovers(cache_file: Optional[Path] = None) -> dict[str, int]:
    """The crossovers measured on this machine so far, by key (provenance, start-up log)."""
    known = _load(Path(cache_file or CACHE_FILE))
    return {key: value["crossover"] for key, value in known.items() if isinstance(value, dict)}
