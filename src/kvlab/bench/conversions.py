"""reports/conversions, measured: SmolLM2-135M against its MQA and MLA conversions, before and after uptraining,
as the GQA paper lays it out: quality against cache against speed, in two servers.

One command, resumable (each run stops once --max-seconds have passed, after the step running):

    flock /tmp/kvlab-heavy.lock kvlab bench conversions --max-seconds 1080

Repeat it until it prints `complete`. The steps, in order, each recorded in results.json with
the command a user would type and this run's provenance:

1. convert: `kvlab convert smollm2-135m` to 1 KV head (aligned) and to DeepSeek-layout MLA at 50%
   and 25% of the cache (calibrated on *Pride and Prejudice*); for comparison, measured before
   training only: 1 KV head mean-pooled (the GQA paper's start), MLA at 75% in DeepSeek's layout, and
   kvlab's weight-SVD layout at 75% and 50% (32 RoPE channels per KV head, as reports/real-models);
2. quality before uptraining: perplexity on *Frankenstein* (2 windows of 2,048 tokens, from token
   1,000, through an fp16 cache 256 tokens at a time, as reports/real-models) and passkey
   retrieval at 2,048 tokens (3 depths x 4 keys x 2 seeds = 24 trials);
3. uptrain: `kvlab uptrain` on *Pride and Prejudice* (distillation from the source, attention and
   norms, UPTRAIN_TOKENS tokens) in slices, then the same quality cells after, once it has finished;
4. serving: for each directory (the MLA ones padded to vLLM's CPU kernel's 512 + 64 latent, which
   computes the same function), the capacity lines kvlab plan predicts, kvlab's engine logs and real
   vLLM logs (1 GiB of KV cache), and vLLM's greedy text against kvlab's on the same ids;
5. speed: `vllm bench serve` (vLLM's own client) against real vLLM and `kvlab serve` at concurrency
   1, 4, 16 and 32 with 128- and 1,024-token prompts, with the fp16 and the fp8 KV cache where the
   server runs it.

Where a server cannot run a directory the cell says why (vLLM's CPU MLA backend caches only in the
model's dtype; `kvlab serve` runs both attentions and both caches), and the pipeline
goes on. Directories live outside the repository (~0.3 GB each): $KVLAB_REPORT_WORK, else
~/.cache/kvlab/conversions.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

MODEL = "smollm2-135m"
OUT = Path(__file__).resolve().parents[3] / "reports" / "conversions"
TRAIN_TEXT, EVAL_TEXT = "pride-and-prejudice.txt", "frankenstein.txt"
PASSKEY_LENGTH, PASSKEY_DEPTHS, PASSKEY_TRIALS, PASSKEY_SEEDS = 2048, (0.1, 0.5, 0.9), 4, (0, 1)
UPTRAIN_TOKENS, SLICE_MINUTES = 32_768, 12.0  # a short uptrain: what 2 shared cores give in a session
UPTRAIN_FLAGS = ["--tokens", str(UPTRAIN_TOKENS), "--batch-size", "2", "--block-size", "512", "--lr", "1e-4"]
KV_SPACE_GIB, VLLM_LATENT, VLLM_ROPE = 1, 512, 64
CONCURRENCY, PROMPT_LENS, OUTPUT_LEN = (1, 4, 16, 32), (128, 1024), 64


@dataclass(frozen=True)
class Variant:
    name: str
    convert: tuple[str, ...]  # kvlab convert's flags; () is the unconverted model
    label: str
    uptrain: bool = True  # uptrained and measured again
    served: bool = True  # capacity, greedy text and speed in both servers
    passkey_seeds: tuple[int, ...] = PASSKEY_SEEDS  # the comparisons' rows take one seed (12 keys): CPU time

    @property
    def mla(self) -> bool:
        return "mla" in self.convert

    @property
    def padded(self) -> bool:
        """Served by vLLM through a copy padded to its CPU kernel's latent (DeepSeek layout only)."""
        return self.mla and "kvlab" not in self.convert


KVLAB_LAYOUT = ("--to", "mla", "--layout", "kvlab", "--rope-dim", "32")  # the old layout, as reports/real-models ran it
VARIANTS = (
    Variant("original", (), "SmolLM2-135M (GQA, 3 KV heads)"),
    Variant("mqa", ("--kv-heads", "1"), "MQA (1 KV head), aligned"),
    Variant("mqa-mean", ("--kv-heads", "1", "--method", "mean"), "MQA (1 KV head), mean-pooled (GQA paper)",
            uptrain=False, served=False, passkey_seeds=(0,)),
    Variant("mla75", ("--to", "mla", "--kv-cache-fraction", "0.75"), "MLA at 75% of the cache, DeepSeek layout",
            uptrain=False, served=False, passkey_seeds=(0,)),
    Variant("mla75-kvlab", (*KVLAB_LAYOUT, "--kv-cache-fraction", "0.75"),
            "MLA at 75%, kvlab layout (weight SVD)", uptrain=False, served=False, passkey_seeds=(0,)),
    Variant("mla50", ("--to", "mla", "--kv-cache-fraction", "0.5"), "MLA at 50% of the cache, DeepSeek layout"),
    Variant("mla50-kvlab", (*KVLAB_LAYOUT, "--kv-cache-fraction", "0.5"),
            "MLA at 50%, kvlab layout (weight SVD)", uptrain=False, served=False, passkey_seeds=(0,)),
    Variant("mla25", ("--to", "mla", "--kv-cache-fraction", "0.25"), "MLA at 25% of the cache, DeepSeek layout"),
)
STAGES = ("converted", "uptrained")


def work_dir() -> Path:
    return Path(os.environ.get("KVLAB_REPORT_WORK", Path.home() / ".cache" / "kvlab" / "conversions"))


def shared_text(name: str) -> Path:
    from kvlab.bench.real_models import shared_file
    return shared_file("data", "english", name)


def directory(variant: Variant, stage: str) -> Path:
    return work_dir() / (variant.name if stage == "converted" else f"{variant.name}-up")


def served_directory(variant: Variant, stage: str) -> Path:
    """What the servers load: the directory itself, or for MLA its copy padded to vLLM's latent width."""
    return directory(variant, stage) if not variant.padded else work_dir() / f"{directory(variant, stage).name}-vllm"


def cli(argv: list[str]) -> tuple[int, str]:
    """kvlab's CLI in a child process (kvlab.bench.cli_child): its exit code and what it printed (its --json)."""
    from kvlab.bench.cli_child import kvlab_cli

    done = kvlab_cli(argv, timeout=None, progress=True)
    return done.returncode, done.stdout


class Results:
    """results.json: finished steps by key, each with the provenance of the run that measured it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"report": "conversions", "steps": {}}

    def done(self, key: str) -> bool:
        return key in self.data["steps"]

    def get(self, key: str) -> Optional[dict]:
        return self.data["steps"].get(key)

    def put(self, key: str, value: dict) -> None:
        from kvlab.bench.provenance import provenance
        from kvlab.files import write_json

        self.data["steps"][key] = {**value, "provenance": provenance()}
        write_json(self.path, self.data)


# -- the steps ---------------------------------------------------------------------------------------------


def convert(variant: Variant) -> dict:
    out = directory(variant, "converted")
    argv = ["convert", MODEL, *variant.convert, "-o", str(out), "--force", "--json"]
    if (out / "config.json").exists():  # converted by this command before (the work folder outlives results.json)
        return {"command": "kvlab " + " ".join(argv[:-4] + ["-o", variant.name]), "reused": str(out)}
    started = time.time()
    code, printed = cli(argv)
    if code != 0:
        raise SystemExit(f"conversions: kvlab {' '.join(argv)} exited {code}")
    report = json.loads(printed)
    return {"command": "kvlab " + " ".join(argv[:-4] + ["-o", variant.name]), "seconds": round(time.time() - started),
            "report": {k: v for k, v in report.items() if k not in ("files", "groups_per_layer")}}


def uptrain_slice(variant: Variant, max_minutes: float) -> Optional[dict]:
    """One slice of the variant's uptraining; its report when the run is finished, else None."""
    src, out = directory(variant, "converted"), directory(variant, "uptrained")
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out)
    argv = ["uptrain", str(out), "--teacher", MODEL, "--data", str(shared_text(TRAIN_TEXT)), *UPTRAIN_FLAGS,
            "--slice-minutes", f"{max(1.0, min(SLICE_MINUTES, max_minutes)):.1f}", "--json"]
    code, printed = cli(argv)
    if code != 0:
        raise SystemExit(f"conversions: kvlab uptrain {variant.name} exited {code}")
    report = json.loads(printed)
    if not report["finished"]:
        return None
    command = f"kvlab uptrain {variant.name}-up --teacher {MODEL} --data {TRAIN_TEXT} {' '.join(UPTRAIN_FLAGS)}"
    return {"command": command, "report": report}


def quality(variant: Variant, stage: str) -> dict:
    """Perplexity and passkey retrieval of one directory (or the source), as reports/real-models measures them."""
    import torch

    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.evals.runner import Evaluator, PasskeyTask, PerplexityTask
    from kvlab.evals.setting import KVSetting
    from kvlab.evals.store import ResultStore
    from kvlab.bench.real_models_study import CHUNK, CONTEXT, OFFSET, WINDOWS

    name = MODEL if variant.name == "original" else str(directory(variant, stage))
    loaded = load_checkpoint(name, torch.float32, "dense")
    # cells kept beside the directories as they finish: a stopped run resumes at the next passkey cell
    store = ResultStore(work_dir() / f"{variant.name}-{stage}.evals.json", {"model": name})
    evaluator = Evaluator(loaded, store)
    setting = KVSetting("fp16")
    ppl = evaluator.perplexity(setting, PerplexityTask(shared_text(EVAL_TEXT), CONTEXT, WINDOWS, CHUNK, OFFSET))
    hits = trials = 0
    for seed in variant.passkey_seeds:
        for depth in PASSKEY_DEPTHS:
            cell, = evaluator.passkey(setting, PasskeyTask((PASSKEY_LENGTH,), (depth,), PASSKEY_TRIALS, seed, CHUNK))
            hits, trials = hits + cell["correct"], trials + cell["trials"]
    return {"perplexity": ppl["perplexity"], "per_window": ppl["per_window_perplexity"],
            "passkey": [hits, trials], "passkey_length": PASSKEY_LENGTH}


def pad(variant: Variant, stage: str) -> dict:
    argv = ["convert", str(directory(variant, stage)), "--pad-latent", str(VLLM_LATENT), "--pad-rope", str(VLLM_ROPE), "-o",
            str(served_directory(variant, stage)), "--force", "--json"]
    code, _ = cli(argv)
    if code != 0:
        raise SystemExit(f"conversions: kvlab convert --pad-latent on {variant.name} exited {code}")
    return {"command": f"kvlab convert DIR --pad-latent {VLLM_LATENT} --pad-rope {VLLM_ROPE} -o DIR-vllm"}


def serving(variant: Variant, stage: str) -> dict:
    """Capacity lines (kvlab plan, kvlab's engine, real vLLM) and vLLM's greedy text against kvlab's."""
    from kvlab.bench.vllm_conversions import kvlab_greedy, planned, vllm_serve
    from kvlab.bench.peers import vllm_python

    path = str(served_directory(variant, stage)) if variant.name != "original" else _original_dir()
    result = {"plan": planned(path), "kvlab_engine": engine_line(path)}
    ours = kvlab_greedy(path, "float32")
    python = vllm_python(None)
    if not os.access(python, os.X_OK):
        result["vllm"] = {"started": False, "error": f"no vLLM venv at {python}"}
        return result
    theirs = vllm_serve(python, path, {kind: r["prompt_ids"] for kind, r in ours.items()})
    result["vllm"] = theirs
    result["kvlab_text"] = {kind: {"text": r["text"], "ids": r["ids"]} for kind, r in ours.items()}
    if theirs.get("started"):
        result["capacity_matches_plan"] = theirs["tokens"] == result["plan"]["tokens"]
        result["text_matches"] = {kind: theirs["texts"][kind]["ids"] == ours[kind]["ids"]
                                  if "error" not in theirs["texts"][kind] else "vLLM " + theirs["texts"][kind]["error"].split(":")[0]
                                  for kind in ours}
    return result


def engine_line(path: str) -> dict:
    """kvlab's engine built on the directory with vLLM's budget: its capacity line, or why it does not serve it."""
    import torch

    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.engine.engine import EngineConfig, LLMEngine

    model = load_checkpoint(path, torch.float32, "dense").model
    try:
        engine = LLMEngine(model, None, EngineConfig(kv_cache_dtype="bf16", kv_cache_memory=KV_SPACE_GIB * 2**30,
                                                     max_model_len=min(4096, model.config.max_seq_len), paged_step=False))
    except Exception as error:  # noqa: BLE001 - the engine's refusal is the cell's content
        return {"served": False, "why": f"{type(error).__name__}: {error}"}
    return {"served": True, "lines": engine.capacity_lines}


def _original_dir() -> str:
    from kvlab.bench.hf_export import hf_dir_for
    return hf_dir_for(MODEL)


def speed(variant: Variant, server: str, kv_dtype: str) -> dict:
    """`vllm bench serve` against one server on one directory: TTFT, ITL and output tok/s per cell."""
    from kvlab.bench.conversions_speed import run_grid

    stage = _stages(variant)[-1]
    # vLLM's CPU kernel needs the padded copy; kvlab serves the conversion itself (its own, narrower cache row)
    path = _original_dir() if variant.name == "original" else str(
        served_directory(variant, stage) if server == "vllm" else directory(variant, stage))
    return run_grid(server, path, kv_dtype, CONCURRENCY, PROMPT_LENS, OUTPUT_LEN)


# -- the order, resumable --------------------------------------------------------------------------------


def steps() -> list[tuple[str, Callable[[], Optional[dict]]]]:
    """(key, step) in the order they run; a step returning None is unfinished (a training slice)."""
    listed: list[tuple[str, Callable]] = []
    converted = [v for v in VARIANTS if v.convert]
    trained = [v for v in converted if v.uptrain]
    served = [v for v in VARIANTS if v.served]
    listed += [(f"convert:{v.name}", lambda v=v: convert(v)) for v in converted]
    listed += [(f"quality:{v.name}:converted", lambda v=v: quality(v, "converted")) for v in VARIANTS]
    listed += [(f"uptrain:{v.name}", lambda v=v: uptrain_slice(v, remaining())) for v in trained]
    listed += [(f"quality:{v.name}:uptrained", lambda v=v: quality(v, "uptrained")) for v in trained]
    listed += [(f"pad:{v.name}:{s}", lambda v=v, s=s: pad(v, s)) for v in served if v.padded
               for s in _stages(v)]
    listed += [(f"serving:{v.name}:{s}", lambda v=v, s=s: serving(v, s)) for v in served for s in _stages(v)]
    for server in ("vllm", "kvlab"):
        for v in served:
            for kv in ("auto", "fp8"):
                listed.append((f"speed:{server}:{v.name}:{kv}", lambda v=v, s=server, k=kv: speed(v, s, k)))
    return listed


def _stages(variant: Variant) -> tuple[str, ...]:
    return STAGES if variant.convert and variant.uptrain else ("converted",)


_deadline = [float("inf")]


def remaining() -> float:
    return max(0.0, (_deadline[0] - time.monotonic()) / 60)


def run(max_seconds: float, only: Optional[str] = None, out: Optional[Path] = None) -> bool:
    """Run pending steps (those whose key starts with `only`, if given) until the time is up, recording them
    in out/results.json (default reports/conversions); True when every step is done."""
    out = out or OUT
    out.mkdir(parents=True, exist_ok=True)
    results = Results(out / "results.json")
    _deadline[0] = time.monotonic() + max_seconds
    for key, step in steps():
        if results.done(key) or (only and not key.startswith(tuple(only.split(",")))):
            continue
        if key.startswith("quality:") and key.endswith(":uptrained") and not results.done(
                "uptrain:" + key.split(":")[1]):
            continue  # an unfinished uptraining's directory holds the converted weights, not the uptrained ones
        if remaining() <= 0:
            return False
        print(f"conversions: {key}", file=sys.stderr)
        value = step()
        if value is None:
            return False
        results.put(key, {**value, "load_average_1m": round(os.getloadavg()[0], 2)})  # the machine is shared
    return all(results.done(key) for key, _ in steps())
