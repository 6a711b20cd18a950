"""The engine's flags, shared by `kvlab serve` and `kvlab bench throughput` (vLLM's names)."""

from __future__ import annotations

import argparse

from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
from kvlab.commands.args import add_model_flags, byte_size, non_negative_int, positive_float, positive_int
from kvlab.engine.config import DEFAULT_MEMORY_FRACTION
from kvlab.nn.matmul_backend import BACKENDS, set_backend
from kvlab.plan.kv_formats import POOL_KV_CACHE_DTYPES


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="smollm2-135m, stories260k, a .gguf file or a Hugging Face model directory")
    model = parser.add_argument_group("model")
    add_model_flags(model)
    model.add_argument("--matmul-backend", choices=BACKENDS, default=None,
                       help="where products of many rows run: kernels (kvlab's C kernels on the GGUF blocks), "
                            "library (torch/oneDNN on a dense copy, bf16 where the CPU has AMX or AVX-512 BF16), "
                            "auto (default: from the row count measured once per machine where the library wins)")
    cache = parser.add_argument_group("KV cache (one paged pool)")
    cache.add_argument("--kv-cache-dtype", default=None, choices=POOL_KV_CACHE_DTYPES,
                       help="pool storage (default: fp16 with fp32 activations, bf16 with bf16: the 16-bit "
                            "precision checkpoints ship in, as vLLM's auto is the model's dtype; twice fp32's "
                            "tokens at the same speed); auto = the activations' dtype. kivi2/kivi4 keep each "
                            "running request's newest 128-159 tokens in full precision, in --max-num-seqs seats; "
                            "kvquant3/kvquant4 keep its sink token and key outliers there (--kv-calibration)")
    cache.add_argument("--kv-calibration", metavar="FILE",
                       help="kvquant3/kvquant4's codebooks and key ranges, from `kvlab calibrate-kv` (default: the "
                            "file it writes beside the model, as `kvlab eval` reads it)")
    cache.add_argument("--pre-rope-keys", action="store_true",
                       help="cache keys before RoPE and rotate them once read, as `kvlab eval --pre-rope-keys` "
                            "measures (module-by-module steps; kvquant3/kvquant4 always do)")
    cache.add_argument("--kv-cache-memory", type=byte_size,
                       help="pool size, e.g. 2GiB or 500MB (default: a fraction of available memory)")
    cache.add_argument("--kv-cache-memory-fraction", type=positive_float, default=DEFAULT_MEMORY_FRACTION,
                       help=f"pool size as a fraction of the machine's available memory "
                            f"(default {DEFAULT_MEMORY_FRACTION})")
    cache.add_argument("--gpu-memory-utilization", type=positive_float, metavar="FRACTION",
                       help="vLLM's flag with its CPU meaning: the fraction of the machine's memory kvlab may use, "
                            "the model included; the pool gets what is left once the model is loaded")
    cache.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                       help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE}: longer runs read faster on CPUs)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="share full prompt blocks between requests (default on, as in vLLM)")
    cache.add_argument("--kv-window", type=positive_int,
                       help="StreamingLLM's policy: each query sees the --sink-tokens first tokens and the newest "
                            "W; blocks out of every future window go back to the pool (in the C step for float and int "
                            "formats without --pre-rope-keys, and KIVI without sinks; KVQuant takes no --sink-tokens)")
    cache.add_argument("--sink-tokens", type=non_negative_int, default=0,
                       help="with --kv-window: attention sinks kept (default 0)")
    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=positive_int, default=64, help="requests per batch (default 64)")
    sched.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                       help="tokens per step, decodes plus prompt chunks (default 2048)")
    sched.add_argument("--max-model-len", type=positive_int, help="prompt + output limit (default: the model's)")
    sched.add_argument("--max-wait-ms", type=float, default=0.0,
                       help="hold new requests until the batch is full or the oldest waited this long (default 0)")
    sched.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                       help="vLLM's flag: kvlab runs one CPU process, so only 1 (the default) is accepted")
    sched.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                       help="vLLM's flag: only 1 (the default) is accepted")
    sched.add_argument("--seed", type=int, default=0, help="seed for requests that set none (default 0)")
    sched.add_argument("--no-paged-step", dest="paged_step", action="store_false",
                       help="run every step module by module (the reference path), not kvlab's C paged step")
    sched.add_argument("--speculative-config", metavar="JSON",
                       help='speculative decoding, as vLLM\'s: {"method": "ngram" | "self" | "draft_model" | '
                            '"eagle" | "medusa", "num_speculative_tokens": k, "prompt_lookup_min": .., '
                            '"prompt_lookup_max": .., "model": DRAFT (draft_model) or HEAD (eagle, medusa), '
                            '"num_layers": L (self), "disable_by_batch_size": N}')


def default_kv_cache_dtype(dtype: str) -> str:
    """The pool's format when --kv-cache-dtype is not given: the 16-bit precision of the activations' family."""
    return "bf16" if dtype == "bf16" else "fp16"


def engine_from_args(args: argparse.Namespace):
    """The LLMEngine the flags describe (loads the model)."""
    if args.kv_cache_dtype is None:
        args.kv_cache_dtype = default_kv_cache_dtype(args.dtype)
    from kvlab.engine.engine import EngineConfig, LLMEngine
    from kvlab.engine.llm import kv_calibration_for, load_for_engine

    if args.matmul_backend:
        set_backend(args.matmul_backend)
    model, tokenizer = load_for_engine(args.model, args.weights, args.dtype, args.threads)
    config = EngineConfig(kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                          kv_cache_memory_fraction=args.kv_cache_memory_fraction, block_size=args.block_size,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, max_wait_ms=args.max_wait_ms,
                          enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, paged_step=args.paged_step,
                          speculative_config=args.speculative_config, kv_window=args.kv_window,
                          sink_tokens=args.sink_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                          tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          kv_calibration=kv_calibration_for(args.model, args.kv_cache_dtype, args.kv_calibration),
                          pre_rope_keys=args.pre_rope_keys)
    return LLMEngine(model, tokenizer, config)
