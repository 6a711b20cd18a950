"""`kvlab bench paged-decode`'s flags; the benchmark itself is kvlab.bench.paged_decode_speed,
imported when the command runs."""

from __future__ import annotations

import argparse

from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
from kvlab.commands.args import comma_list, positive_int, positive_int_list
from kvlab.plan.kv_formats import C_STEP_KV_CACHE_DTYPES

VLLM_GPU_BLOCK = 16  # vLLM's GPU default block, the first of --block-sizes' defaults
HELP = ("decode steps over the paged pool: the C step against the module path, and fp16, int8 and fp8 pools "
        "(or --formats) at a long context, at each block size, the contenders taking turns")
DEFAULT_FORMATS = ["fp16", "int8", "fp8"]


def c_step_formats(text: str) -> list[str]:
    """Comma-separated pool formats the C step runs, fp16 first (the ratios' base) and added if missing."""
    names = comma_list(text)
    unknown = [name for name in names if name not in C_STEP_KV_CACHE_DTYPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected formats the C step runs ({', '.join(C_STEP_KV_CACHE_DTYPES)}), "
                                         f"got {text!r}")
    return ["fp16"] + [name for name in dict.fromkeys(names) if name != "fp16"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=positive_int, default=15, help="timed steps per contender (median; 15)")
    parser.add_argument("--rows", type=positive_int, default=16, help="sequences in the batched steps (16)")
    parser.add_argument("--context", type=positive_int, default=4096,
                        help="tokens per row for the fp16/int8/fp8 steps (4096)")
    parser.add_argument("--block-sizes", type=positive_int_list, default=[VLLM_GPU_BLOCK, DEFAULT_BLOCK_SIZE],
                        help=f"tokens per pool block for the fp16/int8/fp8 steps, comma-separated "
                             f"({VLLM_GPU_BLOCK},{DEFAULT_BLOCK_SIZE}: vLLM's GPU default and the engine's)")
    parser.add_argument("--formats", type=c_step_formats, default=DEFAULT_FORMATS,
                        help="pool formats timed at the long context, comma-separated, fp16 first "
                             "(fp16,int8,fp8; e.g. fp16,int8,int4,int2,kvquant4)")
    parser.add_argument("--kv-calibration", metavar="FILE", default=None,
                        help="KVQuant codebooks for kvquant3/kvquant4 in --formats (`kvlab calibrate-kv`'s file); "
                             "default: fitted on random activations, which times the same")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch (and so OpenMP) threads; 1 keeps a loaded shared machine's barriers out of "
                             "the ratio")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here, with provenance")


def add_parser(benches) -> None:
    parser = benches.add_parser("paged-decode", help=HELP, description=HELP)
    add_arguments(parser)
    parser.set_defaults(run=run_paged)


def run_paged(args: argparse.Namespace) -> int:
    from kvlab.bench import paged_decode_speed
    paged_decode_speed.run(args)
    return 0
