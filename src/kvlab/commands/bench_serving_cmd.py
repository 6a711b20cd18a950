"""`kvlab bench` for reports/serving's pieces and start-up: prefix-ttft, serving-bound, vllm-interop, structured,
lm-eval, reliability and startup.

Each measurement lives in its kvlab.bench module (which prints its figures and writes JSON with
provenance); this file holds only their parsers, so every flag is defined once and `--help`
describes it. scripts/serving_report.sh runs them; `kvlab report serving` renders their JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.commands.args import add_model_flags, positive_float, positive_int
from kvlab.plan.kv_formats import POOL_KV_CACHE_DTYPES

PREFIX_TTFT = "time to first token with one shared prompt prefix, with and without prefix caching (the engine alone)"
SERVING_BOUND = ("the C step's costs for the serving target's workload (one prefill of every prompt, decode steps "
                 "by batch), and the best any schedule could deliver with them")
VLLM_INTEROP = ("vLLM's own `vllm bench serve` (from the vLLM venv) against `kvlab serve`, beside `kvlab bench serve` "
                "on the same workload; PASSED when every agreed ratio is within --tolerance")
STRUCTURED = ("structured outputs: the grammar libraries' costs, the validity of constrained answers and the cost "
              "of a constrained decode step")
LM_EVAL = "lm-evaluation-harness against kvlab serve (GGUF and dense) and vLLM's server, on tasks from ../shared's novels"
RELIABILITY = "a real kvlab serve under streamed requests with client hang-ups: nothing lost, no blocks leaked, RSS"
STARTUP = "cold start-up of `kvlab plan`, the engine and `kvlab serve`, fresh processes, source trees taking turns"


def add_parsers(benches) -> None:
    p = benches.add_parser("prefix-ttft", help=PREFIX_TTFT, description=PREFIX_TTFT)
    p.add_argument("--model", default="smollm2-135m", help="model (default smollm2-135m)")
    p.add_argument("--prefix-tokens", type=positive_int, default=512, help="shared prefix tokens (default 512)")
    p.add_argument("--suffix-tokens", type=positive_int, default=16, help="each request's own tokens (default 16)")
    p.add_argument("--requests", type=positive_int, default=6,
                   help="requests, one at a time (default 6; the median skips the first)")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: all)")
    p.add_argument("--json", metavar="PATH", help="write the result here, with provenance")
    p.set_defaults(run=_runner("prefix_ttft"))

    p = benches.add_parser("serving-bound", help=SERVING_BOUND, description=SERVING_BOUND)
    p.add_argument("--model", default="smollm2-135m", help="a name, a .gguf file or a HF directory")
    add_model_flags(p, weights_default="gguf-a8", dtype=False)
    p.add_argument("--kv-cache-dtype", default="fp16", choices=POOL_KV_CACHE_DTYPES, help="the pool's format (default fp16)")
    p.add_argument("--requests", type=positive_int, default=16, help="prompts in flight (the target's concurrency)")
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens each (default 128)")
    p.add_argument("--output-len", type=positive_int, default=24, help="new tokens each, at least 2 (default 24)")
    p.add_argument("--repetitions", type=positive_int, default=5, help="interleaved repetitions of each cost (5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the costs and bounds here, with provenance")
    p.set_defaults(run=_runner("serving_bound"))

    p = benches.add_parser("vllm-interop", help=VLLM_INTEROP, description=VLLM_INTEROP)
    p.add_argument("--model", default="smollm2-135m", help="model (default smollm2-135m)")
    p.add_argument("--vllm-python", help="the vLLM venv's python (default $KVLAB_VLLM_PYTHON or "
                   "/work/venv-vllm/bin/python)")
    p.add_argument("--num-prompts", type=positive_int, default=16, help="requests per run (default 16)")
    p.add_argument("--max-concurrency", type=positive_int, default=4,
                   help="the loaded run's concurrency (each workload also runs at 1)")
    p.add_argument("--input-len", type=positive_int, default=128, help="random: prompt; prefix_repetition: suffix")
    p.add_argument("--output-len", type=positive_int, default=32, help="new tokens each (default 32)")
    p.add_argument("--prefix-len", type=positive_int, default=256, help="prefix_repetition's prefix (default 256)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    p.add_argument("--threads", type=int, default=0, help="kvlab serve's threads (default: all cores)")
    p.add_argument("--tolerance", type=positive_float, default=1.5,
                   help="each agreed vLLM/kvlab ratio within [1/t, t] (kvlab.bench.vllm_interop: which are agreed)")
    p.add_argument("--json", metavar="PATH", help="write the result here, with provenance")
    p.set_defaults(run=_runner("vllm_interop"))

    p = benches.add_parser("structured", help=STRUCTURED, description=STRUCTURED)
    p.add_argument("--model", default="smollm2-135m", help="model (default smollm2-135m)")
    p.add_argument("--parts", default="backends,validity,step", help="of backends, validity, step (default all)")
    p.add_argument("--answers", type=positive_int, default=100, help="constrained answers to validate (default 100)")
    p.add_argument("--concurrency", type=positive_int, default=16, help="requests at once (default 16)")
    p.add_argument("--repeats", type=positive_int, default=3, help="step-cost runs of each kind, taking turns (3)")
    p.add_argument("--steps", type=positive_int, default=32, help="decode steps timed per step-cost run (32)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    p.add_argument("--json", metavar="PATH", help="write the result here, with provenance")
    p.set_defaults(run=_runner("structured"))

    p = benches.add_parser("lm-eval", help=LM_EVAL, description=LM_EVAL)
    p.add_argument("--model", default="smollm2-135m", help="model (default smollm2-135m)")
    p.add_argument("--servers", default="kvlab,kvlab-dense,vllm", help="comma-separated, from kvlab, kvlab-dense, vllm")
    p.add_argument("--cloze", type=positive_int, default=100, help="cloze items (default 100)")
    p.add_argument("--passkey", type=positive_int, default=20, help="passkey items (default 20)")
    p.add_argument("--quick", action="store_true", help="8 cloze and 4 passkey items")
    p.add_argument("--threads", type=positive_int, default=2, help="each server's threads (default 2)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="lm-eval's prompts per request (default 8)")
    p.add_argument("--tasks-dir", help="where the task YAML and JSON go (default: a temporary directory)")
    p.add_argument("--vllm-python", help="the vLLM venv's python (default /work/venv-vllm/bin/python)")
    p.add_argument("--json", metavar="PATH", help="write the result here, with provenance")
    p.set_defaults(run=run_lm_eval)

    p = benches.add_parser("reliability", help=RELIABILITY, description=RELIABILITY)
    p.add_argument("--model", default="smollm2-135m", help="model (default smollm2-135m)")
    p.add_argument("--requests", type=positive_int, default=1000, help="streamed requests (default 1000)")
    p.add_argument("--max-concurrency", type=positive_int, default=32, help="requests at once (default 32)")
    p.add_argument("--disconnect-fraction", type=float, default=0.1,
                   help="share of clients hanging up mid-stream (default 0.1)")
    p.add_argument("--threads", type=positive_int, help="the server's threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the figures here, with provenance")
    p.set_defaults(run=_runner("reliability"))

    p = benches.add_parser("startup", help=STARTUP, description=STARTUP)
    p.add_argument("--tree", action="append", metavar="LABEL=SRC",
                   help="a source tree to time (repeatable; default: this checkout's src as 'this')")
    p.add_argument("--runs", type=positive_int, default=5, help="counted rounds (default 5; medians over them)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first: kernel builds, page cache")
    p.add_argument("--model", default="smollm2-135m", help="model name for plan NAME, the engine and serve")
    p.add_argument("--gguf", help="the GGUF for `kvlab plan FILE` (default: the model's resolved file)")
    p.add_argument("--kvlab", help="the kvlab executable (default: on PATH)")
    p.add_argument("--pycache", metavar="DIR", help="write and read bytecode under DIR (PYTHONPYCACHEPREFIX), "
                   "as an install with __pycache__ runs; default: this environment as it is")
    p.add_argument("--json-out", type=Path, help="write the results here as JSON (atomically)")
    p.set_defaults(run=_runner("startup"))


def _runner(module: str):
    """The `run` of a sub-command whose body is kvlab.bench.<module>.run_command (imported only when chosen)."""
    def run(args: argparse.Namespace) -> int:
        import importlib
        return importlib.import_module(f"kvlab.bench.{module}").run_command(args)
    return run


def run_lm_eval(args: argparse.Namespace) -> int:
    from kvlab.bench.lm_eval_compare import run_command
    from kvlab.files import write_json
    from kvlab.report.serving_fields import lm_eval_table

    result = run_command(args)
    print(lm_eval_table(result))
    if args.json:
        write_json(Path(args.json), result)
        print(f"wrote {args.json}")
    return 0
