"""`kvlab bench paged-decode`'s flags; the benchmark itself is kvlab.bench.paged_decode_speed,
imported when the command runs."""

from __future__ import annotations

import argparse

from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
from kvlab.commands.args import positive_int, positive_int_list

VLLM_GPU_BLOCK = 16  # vLLM's GPU default block, the first of --block-sizes' defaults
HELP = ("decode steps over the paged pool: the C step against the module path, and fp16, int8 and fp8 pools "
        "at a long context, at each block size, the contenders taking turns")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=positive_int, default=15, help="timed steps per contender (median; 15)")
    parser.add_argument("--rows", type=positive_int, default=16, help="sequences in the batched steps (16)")
    parser.add_argument("--context", type=positive_int, default=4096,
                        help="tokens per row for the fp16/int8/fp8 steps (4096)")
    parser.add_argument("--block-sizes", type=positive_int_list, default=[VLLM_GPU_BLOCK, DEFAULT_BLOCK_SIZE],
                        help=f"tokens per pool block for the fp16/int8/fp8 steps, comma-separated "
                             f"({VLLM_GPU_BLOCK},{DEFAULT_BLOCK_SIZE}: vLLM's GPU default and the engine's)")
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
