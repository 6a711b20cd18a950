"""`kvlab calibrate-kv`: fit KVQuant's per-layer codebooks on calibration text, beside the model.

The file it writes (default `<model>.kvquant.safetensors`, or -o) is what `--kv-cache-dtype
kvquant3|kvquant4` reads in `kvlab eval`. Calibrate on text you will not evaluate on, and like
what the cache will hold: the key ranges are fixed by it, and a prompt unlike it overflows the
outlier pool (reports/real-models: a passkey prompt has 3.3% of its key values outside ranges
fitted on a novel, the pool keeps 0.96%). Repeated --data files share the windows out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.commands.args import positive_int

EXAMPLES = """examples:
  kvlab calibrate-kv smollm2-135m --data ../shared/data/english/pride-and-prejudice.txt
  kvlab calibrate-kv smollm2-135m --data notes.txt --no-sensitivity -o /tmp/smollm2.kvquant.safetensors
  kvlab calibrate-kv smollm2-135m --data notes.txt --kv-heads 1 --method mean   # for a converted model
  kvlab calibrate-kv smollm2-135m --data novel.txt --data traffic.txt --windows 8   # 4 windows from each
"""


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="smollm2-135m, stories260k, a .gguf file or a Hugging Face model directory")
    parser.add_argument("--data", type=Path, action="append", required=True, metavar="FILE",
                        help="a calibration text file (UTF-8); repeat it and the files share the windows out, in order")
    parser.add_argument("-o", "--output", type=Path, help="where to write (default: beside the model)")
    parser.add_argument("--context", type=positive_int, default=512, help="tokens per calibration window (512)")
    parser.add_argument("--windows", type=positive_int, default=4, help="calibration windows (4)")
    parser.add_argument("--no-sensitivity", action="store_true",
                        help="plain k-means (default: weight values by their squared loss gradients)")
    parser.add_argument("--kv-heads", type=positive_int, help="calibrate the model converted to this many KV heads")
    parser.add_argument("--method", default="mean", choices=("mean", "first", "random"), help="the conversion")
    parser.add_argument("--seed", type=int, default=0, help="seed of a random conversion")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvlab.cache.kvquant_calibration import default_calibration_path, save_calibration
    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.calibrate import calibrate, calibration_ids, text_ids
    from kvlab.evals.setting import EvalError, KVSetting, build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    for path in args.data:
        if not path.is_file():
            raise EvalError(f"--data {path}: no such file")
    loaded = load_model(args.model, torch.float32, "dense")
    if loaded.tokenizer is None:
        raise EvalError(f"{loaded.path} has no tokenizer to read --data with")
    model = build_model(loaded, KVSetting(kv_heads=args.kv_heads, method=args.method), args.seed)
    ids = calibration_ids({path.name: text_ids(loaded.tokenizer, path) for path in args.data}, args.context,
                          args.windows)
    names = ", ".join(path.name for path in args.data)
    out = args.output or default_calibration_path(loaded.path, args.kv_heads, args.method)
    from tqdm import tqdm
    with tqdm(total=args.windows, desc="calibrate-kv", unit="window", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        calibration = calibrate(model, ids, args.context, args.windows, not args.no_sensitivity,
                                on_window=bar.update,
                                meta={"model": args.model, "data": names, "kv_heads": args.kv_heads,
                                      "method": args.method if args.kv_heads else None})
    save_calibration(calibration, out)
    summary = {"path": str(out), "layers": len(calibration.layers), "kv_heads": calibration.kv_heads,
               "head_dim": calibration.head_dim, "bits": sorted(calibration.bits), **calibration.meta}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"wrote {out}: {len(calibration.layers)} layers, codebooks for {sorted(calibration.bits)} bits, "
              f"{args.windows} x {args.context} tokens of {names}"
              f"{', sensitivity-weighted' if not args.no_sensitivity else ''}")
    return 0
