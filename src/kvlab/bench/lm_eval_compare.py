"""lm-evaluation-harness against `kvlab serve` and vLLM's server on the same model and tasks.

    flock /tmp/kvlab-heavy.lock kvlab bench lm-eval --json reports/serving/lm_eval.json

lm-eval (PyPI `lm-eval` 0.4.13) scores a served model through its `local-completions` model:
multiple-choice tasks by log-likelihood (each choice sent with the context as one prompt,
`echo`, `logprobs` 1 and one token to generate, the prompt tokens' log-probabilities read
back), generation tasks by greedy completion; its tokenizer is the server's own (`/tokenize`,
`/detokenize`, `/tokenizer_info`, as lm-eval's remote backend finds them). The tasks are built
here from the ../shared novels (kvlab.evals.lm_eval_tasks): nothing comes from a hub.

Servers, one at a time, each alone on the machine: `kvlab` (its default GGUF weights, Q4_1 with
int16 activations), `kvlab-dense` (`--weights dense`: the GGUF dequantised to fp32) and `vllm`
(vLLM's CPU server on kvlab's fp32 HF export of the same GGUF, `--dtype float32`). vLLM and
kvlab-dense thus compute with the same fp32 weights and differ only in the order of their sums;
kvlab's default differs from both by its quantised activations. The result holds each server's
accuracy per task, and for each pair the largest difference of one choice's log-likelihood
over all items, and how many items' answers differ; `--quick` runs a few items.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from kvlab.evals.lm_eval_tasks import CLOZE_TASK, PASSKEY_TASK, write_tasks
from kvlab.errors import KvlabError

SERVERS = ("kvlab", "kvlab-dense", "vllm")
SHARED = Path(__file__).resolve().parents[3].parent / "shared"


def lm_eval_command(base_url: str, model: str, tasks_dir: str, batch_size: int = 8) -> str:
    """The lm_eval command line a user runs for the same evaluation."""
    return (f"lm_eval run --model local-completions --model_args model={model},base_url={base_url}/v1/completions,"
            f"tokenizer_backend=remote,batch_size={batch_size},max_retries=1,timeout=3600 "
            f"--include_path {tasks_dir} --tasks {CLOZE_TASK},{PASSKEY_TASK} --log_samples --output_path OUT")


def evaluate(base_url: str, model: str, tasks_dir: Path, batch_size: int = 8) -> dict:
    """Run lm-eval's two tasks against one server; accuracies and per-item results."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {"model": model, "base_url": f"{base_url}/v1/completions", "tokenizer_backend": "remote",
            "batch_size": batch_size, "max_retries": 1, "timeout": 3600, "num_concurrent": 1}
    started = time.perf_counter()
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[CLOZE_TASK, PASSKEY_TASK],
                                  task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                                  apply_chat_template=False)
    seconds = time.perf_counter() - started
    results = out["results"]
    cloze = sorted(out["samples"][CLOZE_TASK], key=lambda s: s["doc_id"])
    passkey = sorted(out["samples"][PASSKEY_TASK], key=lambda s: s["doc_id"])
    return {
        "seconds": round(seconds, 1),
        "cloze_acc": results[CLOZE_TASK]["acc,none"],
        "passkey_exact_match": results[PASSKEY_TASK]["exact_match,first-number"],
        "cloze_loglikelihoods": [[float(r[0][0]) for r in s["resps"]] for s in cloze],
        "cloze_correct": [bool(s["acc"]) for s in cloze],
        "passkey_answers": [s["filtered_resps"][0] for s in passkey],
        "passkey_correct": [bool(s["exact_match"]) for s in passkey],
    }


def compare(a: dict, b: dict) -> dict:
    """Two servers' per-item results side by side: the largest |difference| of a choice's log-likelihood,
    and the items whose chosen answer (cloze) or generated key (passkey) differ."""
    diffs = [abs(x - y) for ra, rb in zip(a["cloze_loglikelihoods"], b["cloze_loglikelihoods"]) for x, y in zip(ra, rb)]
    pick = [max(range(len(r)), key=r.__getitem__) for r in a["cloze_loglikelihoods"]]
    pick_b = [max(range(len(r)), key=r.__getitem__) for r in b["cloze_loglikelihoods"]]
    return {"max_abs_loglikelihood_diff": max(diffs) if diffs else None,
            "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs) if diffs else None,
            "cloze_choices_differing": sum(x != y for x, y in zip(pick, pick_b)),
            "passkey_answers_differing": sum(x != y for x, y in zip(a["passkey_answers"], b["passkey_answers"]))}


def start(name: str, model: str, port: int, threads: int, vllm_python: Optional[str]):
    """A server under test, started the way a user starts it, with the tokenizer endpoints lm-eval reads."""
    from kvlab.bench.hf_export import hf_dir_for
    from kvlab.bench.peers import Peer, Running, known_peer
    from kvlab.checkpoints.resolve import resolve_model_path

    gguf = resolve_model_path(model)
    if name in ("kvlab", "kvlab-dense"):
        dense = ["--weights", "dense"] if name == "kvlab-dense" else []
        peer = Peer(name, [sys.executable, "-m", "kvlab.cli", "serve", gguf, "--host", "127.0.0.1", "--port",
                           str(port), "--served-model-name", model, "--threads", str(threads), "--kv-cache-memory",
                           "1GiB", "--log-level", "warning", "--enable-tokenizer-info-endpoint", *dense], name)
        return Running(peer, port)
    peer = known_peer("vllm", port, gguf, hf_dir_for(model, "float32"), threads, model, vllm_py=vllm_python)
    if not isinstance(peer, Peer):
        raise RuntimeError(peer.reason)
    at = peer.argv.index("--dtype")
    peer.argv[at + 1] = "float32"  # the same fp32 weights as kvlab-dense
    peer.argv += ["--enable-tokenizer-info-endpoint"]
    return Running(peer, port)


def run(model: str, servers: list[str], cloze: int, passkey: int, threads: int, tasks_dir: Path,
        vllm_python: Optional[str] = None, batch_size: int = 8) -> dict:
    from kvlab.bench.peers import free_ports
    from kvlab.bench.provenance import provenance

    counts = write_tasks(tasks_dir, SHARED, cloze, passkey)
    out = {"model": model, "tasks": counts, "tasks_dir": str(tasks_dir), "servers": {}, "pairs": {},
           "provenance": provenance(threads)}
    for name in servers:
        port = free_ports(1)[0]
        print(f"[lm-eval] {name}: starting", file=sys.stderr)
        server = start(name, model, port, threads, vllm_python)
        try:
            out["servers"][name] = {"command": " ".join(server.peer.argv), "startup_s": round(server.startup_s, 1),
                                    **evaluate(server.base_url, model, tasks_dir, batch_size)}
            out["servers"][name]["lm_eval_command"] = lm_eval_command(server.base_url, model, str(tasks_dir),
                                                                      batch_size)
        finally:
            server.stop()
        r = out["servers"][name]
        print(f"[lm-eval] {name}: cloze acc {r['cloze_acc']:.3f}, passkey {r['passkey_exact_match']:.3f} "
              f"({r['seconds']:.0f} s)", file=sys.stderr)
    done = out["servers"]
    for a, b in (("kvlab-dense", "vllm"), ("kvlab", "vllm"), ("kvlab", "kvlab-dense")):
        if a in done and b in done:
            out["pairs"][f"{a} vs {b}"] = compare(done[a], done[b])
    return out


def run_command(args: argparse.Namespace) -> dict:
    """`kvlab bench lm-eval`: every chosen server in turn; the result (the command prints and writes it)."""
    cloze, passkey = (8, 4) if args.quick else (args.cloze, args.passkey)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown:
        raise KvlabError(f"--servers: unknown server {unknown[0]!r}: choose from {', '.join(SERVERS)}")
    tasks_dir = Path(args.tasks_dir) if args.tasks_dir else Path(tempfile.mkdtemp(prefix="kvlab-lm-eval-"))
    return run(args.model, servers, cloze, passkey, args.threads, tasks_dir, args.vllm_python, args.batch_size)
