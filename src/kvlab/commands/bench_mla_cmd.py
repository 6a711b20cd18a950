"""`kvlab bench mla-decode`'s flags; the benchmark itself is kvlab.bench.mla_decode_speed, imported when
the command runs."""

from __future__ import annotations

import argparse

from kvlab.commands.args import positive_int, positive_int_list

HELP = ("decode steps of `kvlab convert --to mla` directories against their GQA source, every model's "
        "matrices rounded to Q8_0 at load, all in the C step, at short and long contexts, the models "
        "taking turns")
EXAMPLES = """examples:
  kvlab convert smollm2-135m --to mla --layout kvlab --kv-lora-rank full -o smollm2-mla-full
  kvlab bench mla-decode smollm2-mla-full --contexts 128,4096 --rows 1,16 --json reports/mla-decode/smollm2-135m.json
"""


def add_parser(benches) -> None:
    parser = benches.add_parser("mla-decode", help=HELP, description=HELP, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="DIR", help="MLA conversions of --source (directories)")
    parser.add_argument("--source", default="smollm2-135m", help="the GQA model they were converted from")
    parser.add_argument("--contexts", type=positive_int_list, default=[128, 4096],
                        help="tokens each row holds, comma-separated (128,4096)")
    parser.add_argument("--rows", type=positive_int_list, default=[1, 16],
                        help="sequences per step, comma-separated (1,16)")
    parser.add_argument("--kv-cache-dtype", default="fp16", choices=["fp32", "fp16", "bf16", "fp8"],
                        help="every model's pool format (fp16)")
    parser.add_argument("--repeats", type=positive_int, default=15, help="timed steps per contender (median; 15)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch (and so OpenMP) threads; 1 keeps a loaded shared machine's barriers out of "
                             "the ratio")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here, with provenance")
    parser.set_defaults(run=run_mla)


def run_mla(args: argparse.Namespace) -> int:
    from kvlab.bench import mla_decode_speed
    mla_decode_speed.run(args)
    return 0
