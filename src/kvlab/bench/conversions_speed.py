"""reports/conversions' speed cells: vLLM's own client (`vllm bench serve`) against one server on one directory.

One server is started per (directory, KV cache dtype) and measured at every concurrency and prompt
length of the grid, 2 x concurrency requests (at least 4) of random tokens each, OUTPUT_LEN tokens
out (ignore_eos), its prefix cache reset before each cell. vLLM's CPU MLA backend caches only in the
model's dtype: those cells record why, not a number. `kvlab serve` runs either attention, fp8 included,
with `--weights q8_0` (KVLAB_WEIGHTS): a safetensors directory otherwise loads dense and decodes module by
module, at a fifth of the C step's speed; Q8_0 rounds every matrix as GGUF does, the same for the source and
its conversions, so their ratios hold.

A cell predicted to run past CELL_BUDGET_S (the last cell of its prompt length's time, scaled by its
requests) is skipped with that prediction, as are the larger ones after it: on a 2-core AVX2 machine real
vLLM prefills a 1,024-token prompt in about 50 s, so its 64-request cell would take the best part of an
hour, and the session's other steps would not run.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Sequence

from kvlab.bench.conversions import KV_SPACE_GIB

CELL_BUDGET_S = 600.0
KVLAB_WEIGHTS = "q8_0"
METRICS = ("mean_ttft_ms", "median_ttft_ms", "mean_itl_ms", "median_itl_ms", "output_throughput", "completed", "failed")


def peer(server: str, path: str, kv_dtype: str, port: int):
    """The server's start command on this directory, or a reason it cannot serve it."""
    from kvlab.bench.peers import Peer, vllm_python
    from kvlab.checkpoints.hf import config_from_json
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        mla = config_from_json(json.load(handle)).attention == "mla"
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if server == "kvlab":
        import sys
        return Peer("kvlab", [sys.executable, "-m", "kvlab.cli", "serve", path, *host, "--served-model-name", "m",
                              "--kv-cache-memory", f"{KV_SPACE_GIB}GiB", "--max-model-len", "4096",
                              "--kv-cache-dtype", "fp16" if kv_dtype == "auto" else kv_dtype, "--weights",
                              KVLAB_WEIGHTS, "--log-level", "warning"], startup_timeout_s=300.0)
    python = vllm_python(None)
    if not os.access(python, os.X_OK):
        return f"no vLLM venv at {python}"
    if mla and kv_dtype != "auto":
        return "vLLM's CPU MLA backend caches the latent in the model's dtype only"
    return Peer("vllm", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--dtype", "bfloat16",
                         "--served-model-name", "m", *host, "--max-model-len", "4096", "--kv-cache-dtype", kv_dtype,
                         "--uvicorn-log-level", "warning"], startup_timeout_s=600.0,
                env={"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                     "DO_NOT_TRACK": "1", "PYTHONPATH": "",
                     "VLLM_SERVER_DEV_MODE": "1"})  # dev mode: vLLM's /reset_prefix_cache


def run_grid(server: str, path: str, kv_dtype: str, concurrency: Sequence[int], prompt_lens: Sequence[int],
             output_len: int) -> dict:
    from kvlab.bench.peers import Running, free_ports, vllm_python
    from kvlab.bench.vllm_interop import dataset_flags, reset_prefix_cache, run_vllm_bench
    from kvlab.errors import KvlabError

    port = free_ports(1)[0]
    start = peer(server, path, kv_dtype, port)
    if isinstance(start, str):
        return {"served": False, "why": start}
    try:
        running = Running(start, port)
    except KvlabError as error:
        return {"served": False, "why": f"did not start: {str(error)[-600:]}"}
    cells = {}
    try:
        with tempfile.TemporaryDirectory(prefix="kvlab-conv-speed-") as workdir:
            for length in prompt_lens:
                flags = dataset_flags("random", length, output_len, 0)[0]
                last = None  # (requests, seconds) of this length's previous cell
                for level in concurrency:
                    requests = max(4, 2 * level)
                    predicted = last[1] * requests / last[0] if last else 0.0
                    if predicted > CELL_BUDGET_S:
                        cells[f"in{length}-c{level}"] = {"skipped": f"predicted {predicted:.0f} s (over "
                                                                    f"{CELL_BUDGET_S:.0f} s)"}
                        continue
                    with contextlib.suppress(Exception):  # a cold prefix cache where the server can reset it
                        reset_prefix_cache(running.base_url)
                    began = time.monotonic()
                    result = run_vllm_bench(vllm_python(None), running.base_url, "m", path, flags,
                                            requests, level, level, workdir)  # seed: fresh prompts per cell
                    last = (requests, time.monotonic() - began)
                    cells[f"in{length}-c{level}"] = {**{m: result.get(m) for m in METRICS},
                                                     "seconds": round(last[1], 1)}
    finally:
        running.stop()
    weights = {"weights": KVLAB_WEIGHTS} if server == "kvlab" else {"dtype": "bfloat16"}
    return {"served": True, "startup_s": round(running.startup_s, 1), "cells": cells, **weights,
            "client": "vllm bench serve (random dataset, ignore_eos, temperature 0)"}
