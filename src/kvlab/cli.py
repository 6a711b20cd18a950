"""The `kvlab` command: one entry point, one module per sub-command under `kvlab.commands`.

Each sub-command module exposes `add_parser(subparsers)` and `run(args) -> int`, and is
imported only when chosen, so `kvlab plan` never pays for torch.
User mistakes raise `KvlabError` (PlanError, CacheError, ...) and end here as one line on stderr,
exit 2; a machine that fails kvlab (`KvlabEnvironmentError`, a kernel build) is one line, exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn, Optional, Sequence

from kvlab import __version__
from kvlab.errors import KvlabEnvironmentError, KvlabError

# name -> (module under kvlab.commands, one-line help)
COMMANDS = {
    "plan": ("plan_cmd", "KV-cache, weight, seats and latency arithmetic for a model"),
    "chart": ("chart_cmd", "interactive HTML chart (or PNG) of KV-cache size against context"),
    "generate": ("generate_cmd", "generate text with a real model (GGUF or HF directory)"),
    "measure": ("measure_cmd", "run a real model: planned versus measured cache bytes, prefill/decode speed"),
    "study": ("study_cmd", "reproducible studies (gqa: MHA vs GQA vs MQA vs MLA, with uptraining)"),
    "serve": ("serve_cmd", "OpenAI-compatible server: continuous batching over one paged KV pool"),
    "convert": ("convert_cmd", "convert a checkpoint between MHA, GQA, MQA and MLA for transformers/llama.cpp"),
    "uptrain": ("uptrain_cmd", "distil a converted model from its source (KL on teacher logits + LM loss)"),
    "export": ("export_cmd", "the vllm serve command for a converted model, and the capacity vLLM will log"),
    "fleet": ("fleet_cmd", "size a serving fleet: simulate the engine's scheduler for tail latency, cards and cost"),
    "bench": ("bench_cmd", "benchmarks: throughput, decode (offline), serve (a server under load), compare "
                           "(peers), paged-decode (the C step by KV format and block size), and every report's "
                           "measurement (speculative, real-models, vllm-interop, ...)"),
    "report": ("report_cmd", "re-render a report's page under reports/ from its JSON alone (measures nothing)"),
    "draft": ("draft_cmd", "a speculative-decoding draft distilled from the target's own text (corpus, train)"),
    "eval": ("eval_cmd", "quality under a KV setting: perplexity and passkey retrieval through the cache"),
    "calibrate-kv": ("calibrate_kv_cmd", "fit KVQuant's per-layer KV codebooks on calibration text (kvquant3/4)"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (exit 2), not a usage dump, and a flag is
    never guessed from its start: `--output PATH` was taken as `--output-len PATH`. Sub-command
    parsers are built by the same class (argparse's add_subparsers defaults to the parent's type)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(selected: Optional[str] = None) -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvlab", description="Inference-aware model design: plan, chart, generate, measure, study.")
    parser.add_argument("--version", action="version", version=f"kvlab {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if selected == name:
            module = importlib.import_module(f"kvlab.commands.{module_name}")
            module.add_parser(subparsers, name, help_text)
        else:
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(selected if selected in COMMANDS else None)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as typed after `kvlab`: benchmarks record the command that made their figures
    if not args.command:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except KvlabError as error:
        print(f"kvlab {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KvlabEnvironmentError as error:
        print(f"kvlab {args.command}: error: {error}", file=sys.stderr)
        return 1
    except FileNotFoundError as error:
        print(f"kvlab {args.command}: error: no such file: {error.filename or error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvlab ... | head` closed the pipe: not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"kvlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
