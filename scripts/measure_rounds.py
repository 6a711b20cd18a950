#!/usr/bin/env python3
"""`kvlab measure` for several KV formats taking turns, a few rounds, into one JSON.

    python3 scripts/measure_rounds.py OUT.json --formats fp16,int4 --rounds 2 -- smollm2-135m --threads 1 \
        --prompt-len 2048 --new-tokens 64

Each round runs `kvlab measure ARGS --kv-cache-dtype F --json` once per format, in order, so that
load from other processes on a shared machine falls on every format alike; the ratio to compare
is within a round. Written atomically: {"what", "runs": [{"round", "command", "result"}]}.
(scripts/serving_report.sh's `int4` piece; run it under the heavy lock.)
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kvlab.files import write_json  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON to write")
    parser.add_argument("--formats", default="fp16,int4", help="KV formats, comma-separated (fp16,int4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each format once per round (2)")
    parser.add_argument("--what", default="", help="one line saying what was measured, and where")
    argv = sys.argv[1:]
    if "--" not in argv:
        parser.error("give kvlab measure's arguments after --")
    at = argv.index("--")
    args, measure = parser.parse_args(argv[:at]), argv[at + 1:]
    runs = []
    for round_ in range(1, args.rounds + 1):
        for fmt in args.formats.split(","):
            command = ["kvlab", "measure", *measure, "--kv-cache-dtype", fmt, "--json"]
            done = subprocess.run([sys.executable, "-m", "kvlab.cli", *command[1:]], check=True,
                                  capture_output=True, text=True)
            result = json.loads(done.stdout)
            print(f"round {round_} {fmt}: decode {result['decode_tokens_per_s']:.1f} tok/s, "
                  f"prefill {result['prefill_tokens_per_s']:.1f} tok/s", flush=True)
            runs.append({"round": round_, "command": shlex.join(command), "result": result})
    write_json(args.out, {"what": args.what, "runs": runs})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
