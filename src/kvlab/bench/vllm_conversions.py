"""SmolLM2-135M and its KV-head conversions served by real vLLM: capacity lines and greedy text against kvlab's.

    flock /tmp/kvlab-heavy.lock kvlab bench vllm-conversions [--variants original,mqa] \
        [--json reports/real-models/conversions.json]
    kvlab report vllm-conversions reports/real-models/conversions.json   # the .md only

`kvlab convert` claims its directories are what vLLM serves and `kvlab plan --engine vllm`
claims to predict what vLLM logs for them; this checks both on this machine. For each variant
(kvlab's HF export of SmolLM2 = `original`; `kvlab convert --kv-heads 1` = `mqa`; `--kv-heads 9`
= `mha`) it starts vLLM's OpenAI server from its own venv (one at a time, VLLM_CPU_KVCACHE_SPACE
= 1 GiB, start capped at 8 minutes), reads the "KV cache size: N tokens" line from its log,
compares N with the planner's `gpu_kv_cache_tokens` for the same directory and budget (CPU
backend: blocks of 128 tokens), then sends the prompts as token ids (so both engines see the
same input) with temperature 0 and max_tokens 16 and compares vLLM's text with kvlab's greedy
text for the same directory (dense weights, in fp32 and in bf16; vLLM runs bf16, so a mismatch
may be precision, and it is recorded, not hidden). `--to mla --layout kvlab` conversions are not
served: the script records `kvlab export --vllm`'s refusal and its reason (DeepSeek-layout MLA is served
by reports/conversions, kvlab.report.conversions). The JSON (with provenance) is
the record; the .md beside it is rendered from the JSON alone. tests/bench/test_vllm_conversions.py
(slow; skipped without the vLLM venv, even under CI, which has none) runs the original only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from kvlab.bench.cli_child import kvlab_cli
from kvlab.errors import KvlabError

PROMPTS = (("completion", "The capital of France is"), ("chat", "What is the capital of France?"))
MAX_TOKENS = 16
KV_SPACE_GIB = 1
START_CAP_S = 480.0
VARIANTS = {"original": None, "mqa": ["--kv-heads", "1", "--method", "mean"], "mha": ["--kv-heads", "9"]}
CAPACITY = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")
REPORT = Path("reports/real-models/conversions.json")


def variant_dir(name: str, workdir: str) -> str:
    """The HF directory of a variant: kvlab's export of SmolLM2 (cached), or a fresh `kvlab convert` of it."""
    from kvlab.bench.hf_export import hf_dir_for

    if VARIANTS[name] is None:
        return hf_dir_for("smollm2-135m")
    out = os.path.join(workdir, name)
    done = kvlab_cli(["convert", "smollm2-135m", "-o", out, *VARIANTS[name]])
    if done.returncode != 0:
        raise RuntimeError(f"kvlab convert {' '.join(VARIANTS[name])} exited {done.returncode}: {done.stderr[-500:]}")
    return out


def planned(directory: str) -> dict:
    """kvlab's prediction for vLLM's CPU backend with the same budget, read from `kvlab plan --json`."""
    argv = ["plan", directory, "--engine", "vllm", "--vllm-device", "cpu", "--kv-cache-memory", f"{KV_SPACE_GIB}GiB",
            "--dtype", "bf16", "--json"]
    done = kvlab_cli(argv)
    if done.returncode != 0:
        raise RuntimeError(f"kvlab plan exited {done.returncode}: {done.stderr[-500:]}")
    plan = json.loads(done.stdout)
    return {"command": "kvlab " + " ".join(argv[:-1]).replace(directory, "DIR"), "q_heads": plan["model"]["q_heads"],
            "kv_heads": plan["model"]["kv_heads"], "kv_bytes_per_token": plan["kv_bytes_per_token"],
            "block_size": plan["vllm"]["block_size"], "tokens": plan["vllm"]["gpu_kv_cache_tokens"],
            "log_lines": plan["vllm"]["log_lines"]}


def kvlab_greedy(directory: str, dtype: str) -> dict:
    """kvlab's greedy continuation of each prompt (dense weights, `dtype` activations): ids and text."""
    import torch

    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.checkpoints.tokenizer import prompt_ids as ids_of
    from kvlab.nn.generate import generate

    loaded = load_checkpoint(directory, getattr(torch, dtype), "dense")
    model, tokenizer = loaded.model, loaded.tokenizer
    stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    result = {}
    for kind, text in PROMPTS:
        ids = ids_of(tokenizer, text, kind == "chat")
        cache = model.new_cache(1, len(ids) + MAX_TOKENS, "auto")
        with torch.no_grad():
            new = generate(model, ids, MAX_TOKENS, 0.0, None, torch.Generator().manual_seed(0), cache, stop_ids=stop)
        out = [int(t) for t in new[0]]
        result[kind] = {"prompt_ids": ids, "ids": out, "text": tokenizer.decode(out)}
    return result


def vllm_peer(python: str, directory: str, port: int):
    from kvlab.bench.peers import Peer

    return Peer("vllm", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", directory, "--dtype", "bfloat16",
                         "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                         "4096", "--uvicorn-log-level", "warning"],
                startup_timeout_s=START_CAP_S,
                env={"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                     "DO_NOT_TRACK": "1", "PYTHONPATH": ""})


def vllm_serve(python: str, directory: str, prompts: dict) -> dict:
    """Start vLLM on `directory`, read its capacity line, send each prompt's ids greedily, stop it."""
    import httpx

    from kvlab.bench.peers import Running, free_ports
    from kvlab.errors import KvlabError

    port = free_ports(1)[0]
    started = time.time()
    try:
        server = Running(vllm_peer(python, directory, port), port)
    except KvlabError as error:
        return {"started": False, "error": str(error)[-3000:], "after_s": round(time.time() - started, 1)}
    try:
        server.log.flush()
        log = Path(server.log.name).read_text(errors="replace")
        lines = [line for line in log.splitlines() if CAPACITY.search(line)]
        match = CAPACITY.search(lines[0]) if lines else None
        texts = {}
        for kind, ids in prompts.items():
            reply = httpx.post(server.base_url + "/v1/completions", timeout=300,
                               json={"model": "m", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                     "logprobs": 0, "return_tokens_as_token_ids": True})
            if reply.status_code != 200:  # recorded with the server's last lines, not a lost run
                server.log.flush()
                tail = [line for line in Path(server.log.name).read_text(errors="replace").splitlines() if line][-12:]
                texts[kind] = {"error": f"HTTP {reply.status_code}: {reply.text[:300]}", "log_tail": tail}
                continue
            choice = reply.json()["choices"][0]
            tokens = (choice.get("logprobs") or {}).get("tokens") or []
            texts[kind] = {"text": choice["text"], "finish_reason": choice.get("finish_reason"),
                           "ids": [int(t.split(":", 1)[1]) for t in tokens if t.startswith("token_id:")]}
        return {"started": True, "startup_s": round(server.startup_s, 1),
                "capacity_line": lines[0].split("] ")[-1].strip() if lines else None,
                "tokens": int(match.group(2).replace(",", "")) if match else None, "texts": texts,
                "version": _vllm_version(python)}
    finally:
        server.stop()


def _vllm_version(python: str) -> Optional[str]:
    done = subprocess.run([python, "-c", "import importlib.metadata as m\n"
                           "for name in ('vllm', 'vllm-cpu'):\n"
                           "    try:\n        print(name, m.version(name)); break\n"
                           "    except m.PackageNotFoundError:\n        pass"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    return done.stdout.strip() or None


def mla_refusal(workdir: str) -> dict:
    """`kvlab convert --to mla`, then `kvlab export --vllm` on it: the exit code and the one line it prints."""
    out = os.path.join(workdir, "mla")
    convert = kvlab_cli(["convert", "smollm2-135m", "-o", out, "--to", "mla", "--layout", "kvlab", "--kv-lora-rank",
                         "full"])
    if convert.returncode != 0:
        return {"convert_rc": convert.returncode, "convert_error": convert.stderr.strip()[-500:]}
    export = kvlab_cli(["export", out, "--vllm"])
    return {"convert_rc": 0, "command": "kvlab export DIR --vllm", "export_rc": export.returncode,
            "export_message": (export.stderr.strip() or export.stdout.strip()).replace(out, "DIR")[-800:]}


def run_variant(name: str, python: str, workdir: str) -> dict:
    directory = variant_dir(name, workdir)
    plan = planned(directory)
    ours = {dtype: kvlab_greedy(directory, dtype) for dtype in ("float32", "bfloat16")}
    theirs = vllm_serve(python, directory, {kind: r["prompt_ids"] for kind, r in ours["float32"].items()})
    row = {"variant": name, "convert": VARIANTS[name], "plan": plan, "vllm": theirs,
           "kvlab": {dtype: {k: {"text": r["text"], "ids": r["ids"]} for k, r in per.items()}
                     for dtype, per in ours.items()},
           "prompts": {k: r["prompt_ids"] for k, r in ours["float32"].items()}}
    if theirs.get("started"):
        row["capacity_matches_plan"] = theirs["tokens"] == plan["tokens"]
        row["text_matches"] = {dtype: {k: theirs["texts"][k]["text"] == per[k]["text"] for k in per}
                               for dtype, per in ours.items()}
    return row


def measure(variants: list[str], vllm_python: Optional[str] = None, mla: bool = True,
            budget_s: float = 900.0) -> dict:
    from kvlab.bench.peers import vllm_python as find_python
    from kvlab.bench.provenance import provenance

    python = find_python(vllm_python)
    if not os.access(python, os.X_OK):
        raise SystemExit(f"no vLLM venv python at {python}: run scripts/setup_vllm_venv.sh first")
    with tempfile.TemporaryDirectory(prefix="kvlab-vllm-conv-") as workdir:
        rows, spent, longest = [], 0.0, 0.0
        for name in variants:
            if rows and spent + longest > budget_s:  # the next start would likely overrun the vLLM budget
                rows.append({"variant": name, "skipped": f"vLLM budget: {spent:.0f} s spent of {budget_s:.0f} s"})
                continue
            started = time.time()
            rows.append(run_variant(name, python, workdir))
            took = time.time() - started
            spent, longest = spent + took, max(longest, took)
        skipped = [r for r in rows if "skipped" in r]
        rows = [r for r in rows if "skipped" not in r]
        refusal = mla_refusal(workdir) if mla else None
    base = next((r for r in rows if r["variant"] == "original" and r["vllm"].get("tokens")), None)
    for row in rows:
        if base and row["vllm"].get("tokens"):
            row["tokens_over_original"] = row["vllm"]["tokens"] / base["vllm"]["tokens"]
    return {"benchmark": "vllm_conversions", "model": "smollm2-135m", "kv_cache_space_gib": KV_SPACE_GIB,
            "max_tokens": MAX_TOKENS, "prompts": dict(PROMPTS), "variants": rows, "skipped": skipped, "mla": refusal,
            "provenance": provenance()}


def run_command(args: argparse.Namespace) -> dict:
    """`kvlab bench vllm-conversions`: measure the chosen variants, write --json; the result."""
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise KvlabError(f"--variants: unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    result = measure(names, args.vllm_python, not args.no_mla, args.budget_s)
    if args.json:
        from kvlab.files import write_json
        write_json(Path(args.json), result)
    return result
