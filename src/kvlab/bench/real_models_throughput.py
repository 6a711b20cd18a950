"""The real-models report's throughput column, measured: kvlab's engine decoding 16 concurrent requests per KV setting.

The quality columns say what a cache format costs; this one says what it buys or costs in
speed on this machine, through the engine a user would serve it with (the GGUF model, the
fused C step where it serves the format, module by module where it does not: `decode_path`
says which). Each setting's figure is one `kvlab.bench.throughput.run_engine` run of the
same random prompts, after a warm-up on a prompt of its own, kept in engine_throughput.json
with the run's provenance; a setting already there is not measured again.

Every KV format and pre-RoPE keys are measured on the GGUF model (KVQuant with the study's
calibration). The in-memory KV-head and MLA conversions cannot be: the GGUF blocks are not
converted. The engine serves them as a converted checkpoint would be served (`kvlab convert`, then
`kvlab serve OUT`: dense weights), so they are measured on the dense model converted in memory, and
the row says "dense weights": its speed is the conversion's and the dense products', not comparable
with the GGUF rows'. The uptrained row's weights are its training run's, not measured here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from kvlab.evals.setting import KVSetting
from kvlab.files import write_json

REQUESTS, INPUT_LEN, OUTPUT_LEN = 16, 128, 64
POOL_BYTES = 512 * 2**20
FILE = "engine_throughput.json"  # SmolLM2's runs (a study names its own: Study.engine_runs)


def served(setting: KVSetting) -> bool:
    """Whether this run measures the setting: every one but the uptrained conversion's."""
    return not setting.uptrain_steps


def converted(setting: KVSetting) -> bool:
    """A setting whose model is converted in memory (KV heads, MLA): measured on dense weights."""
    return setting.kv_heads is not None or setting.mla_rank is not None


def load(out: Path, file: str = FILE) -> dict:
    """A study's runs file (Study.engine_runs), or an empty one."""
    path = out / file
    return json.loads(path.read_text()) if path.exists() else {"workload": workload(), "rows": {}}


def workload() -> dict:
    return {"requests": REQUESTS, "concurrency": REQUESTS, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
            "kv_cache_memory": POOL_BYTES, "prompts": "random ids, dataset seed 0 (kvlab.bench.throughput)"}


def pending(out: Path, settings: Sequence[KVSetting], file: str = FILE) -> list[KVSetting]:
    done = load(out, file)["rows"]
    return [s for s in settings if served(s) and s.label not in done]


def measure(out: Path, model_name: str, setting: KVSetting, threads: int, calibration: Optional[Path] = None,
            dense=None, file: str = FILE) -> dict:
    """One setting's run, added to the study's runs file (written atomically) and returned; a KVQuant setting
    reads `calibration`, a converted one is built from `dense` (the model loaded with dense weights)."""
    import torch

    from kvlab.bench.provenance import provenance
    from kvlab.bench.throughput import random_prompts, run_engine, special_ids
    from kvlab.engine.engine import EngineConfig, LLMEngine
    from kvlab.engine.llm import load_for_engine
    from kvlab.errors import KvlabError

    if converted(setting):
        from kvlab.evals.setting import build_model
        model, tokenizer = build_model(dense, setting), dense.tokenizer
    else:
        model, tokenizer = load_for_engine(model_name, threads=threads)
    try:
        engine = LLMEngine(model, tokenizer, EngineConfig(
            kv_cache_dtype=setting.kv_cache_dtype, kv_cache_memory=POOL_BYTES, max_num_seqs=REQUESTS,
            kv_window=setting.window, sink_tokens=setting.sinks, pre_rope_keys=setting.pre_rope,
            kv_calibration=str(calibration) if setting.is_kvquant and calibration else None))
    except KvlabError as error:  # the engine refuses the setting: that is the cell (one line, kept)
        return _store(out, file, setting, {"refused": str(error), "provenance": provenance(torch.get_num_threads())})
    prompts = random_prompts(REQUESTS + 1, INPUT_LEN, model.config.vocab_size, 0, special_ids(tokenizer))
    run_engine(engine, prompts[-1:], 4)  # a prompt of its own: the measured ones are not in the prefix cache
    figures = run_engine(engine, prompts[:-1], OUTPUT_LEN)
    figures["capacity_lines"] = engine.capacity_lines
    figures["block_size"] = engine.config.block_size
    figures["weights"] = model.packing
    figures["provenance"] = provenance(torch.get_num_threads())
    return _store(out, file, setting, figures)


def _store(out: Path, file: str, setting: KVSetting, figures: dict) -> dict:
    doc = load(out, file)
    doc["rows"][setting.label] = figures
    write_json(out / file, doc, indent=1)
    return figures
