"""The model and plan flags that `kvlab plan` and `kvlab chart` share, and how they become inputs."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from kvlab.commands.args import byte_size, positive_float, positive_int
from kvlab.plan.draft_heads import DraftHead, read_draft_head
from kvlab.plan.errors import PlanError
from kvlab.plan.hardware import Device, custom_device, device, devices
from kvlab.plan.kv_formats import KV_CACHE_DTYPES, MODEL_DTYPES
from kvlab.plan.loaders import explicit_model, load_model
from kvlab.plan.planner import PlanRequest
from kvlab.plan.spec import ModelSpec
from kvlab.plan.speculative import check_speculation
from kvlab.plan.vllm_versions import DEFAULT_VERSION, RELEASES
from kvlab.plan.weights import WEIGHT_DTYPES


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="preset name, config.json (file or directory) or .gguf file")
    shape = parser.add_argument_group("explicit shape (instead of MODEL) and what-if overrides")
    shape.add_argument("--layers", type=positive_int, help="number of layers")
    shape.add_argument("--heads", type=positive_int, help="query heads")
    shape.add_argument("--kv-heads", type=positive_int,
                       help="KV heads; with MODEL, turns it into GQA/MQA/MHA (what-if)")
    shape.add_argument("--head-dim", type=positive_int, help="head dimension")
    shape.add_argument("--hidden", type=positive_int, help="hidden size (for parameter estimates)")
    shape.add_argument("--params", type=positive_float, help="parameter count, e.g. 8e9")
    shape.add_argument("--mla-rank", type=positive_int, help="what-if MLA: latent rank (kv_lora_rank)")
    shape.add_argument("--mla-rope-dim", type=positive_int, default=None, help="what-if MLA: RoPE key dim (64)")
    shape.add_argument("--kv-window", type=positive_int,
                       help="what-if sinks + window cache (StreamingLLM): full layers hold --sink-tokens + this many")
    shape.add_argument("--sink-tokens", type=int, default=0, help="with --kv-window: attention sinks kept (0)")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model the flags describe, with any what-if override applied."""
    if args.model is None and args.layers is not None:
        if args.heads is None:
            raise PlanError("an explicit shape needs --layers and --heads (and --kv-heads, --head-dim)")
        params = int(args.params) if args.params else None
        spec = explicit_model(args.layers, args.heads, args.kv_heads, args.head_dim, args.hidden, params)
    else:
        if args.model is not None and (args.layers or args.heads or args.head_dim):
            raise PlanError("give either MODEL or --layers/--heads/--head-dim, not both")
        spec = load_model(args.model)
        if args.params:
            spec = replace(spec, params_total=int(args.params), params_active=None, weight_bytes=None,
                           weight_format=None, checkpoint_bytes=None)
        if args.kv_heads is not None:
            spec = spec.with_kv_heads(args.kv_heads)
    if args.mla_rank is not None:
        spec = spec.with_mla(args.mla_rank, 64 if args.mla_rope_dim is None else args.mla_rope_dim)
    elif args.mla_rope_dim is not None:
        raise PlanError("--mla-rope-dim needs --mla-rank")
    if getattr(args, "kv_window", None) is not None:
        spec = spec.with_kv_window(args.kv_window, args.sink_tokens)
    elif getattr(args, "sink_tokens", 0):
        raise PlanError("--sink-tokens needs --kv-window")
    return spec


def add_speculative_arguments(parser: argparse.ArgumentParser, acceptance_help: str) -> argparse._ArgumentGroup:
    """--draft, --acceptance-rate, --num-speculative-tokens: `kvlab plan`'s, which `kvlab fleet` shares; the group,
    for flags of one command's own."""
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--draft", metavar="MODEL", help="a draft model (preset, config.json or .gguf): its weights "
                                                       "and KV join the budget, and seats fall accordingly; or a "
                                                       "draft head directory (kvlab draft train --method eagle|medusa):"
                                                       " its weights join, no KV, and its recorded held-out agreement "
                                                       "is the acceptance rate unless --acceptance-rate is given")
    spec.add_argument("--acceptance-rate", type=float, help=acceptance_help)
    spec.add_argument("--num-speculative-tokens", type=positive_int, default=3, help="drafted tokens k (3)")
    return spec


def draft_from_args(args: argparse.Namespace, need_rate: bool = False) -> tuple[ModelSpec | None, float | None, int]:
    """(draft spec, acceptance rate, k) from the speculative flags, checked as kvlab.plan.speculative checks them."""
    if args.draft is None:
        if args.acceptance_rate is not None:
            raise PlanError("--acceptance-rate needs --draft MODEL")
        return None, None, args.num_speculative_tokens
    draft = load_draft(args.draft)
    if args.acceptance_rate is None and isinstance(draft, DraftHead) and draft.held_out_agreement is not None:
        check_speculation(draft.held_out_agreement, args.num_speculative_tokens)
        return draft, draft.held_out_agreement, args.num_speculative_tokens  # the head's recorded agreement
    if args.acceptance_rate is None:
        if need_rate:
            raise PlanError("--draft needs --acceptance-rate A (the chance the target accepts each drafted token)")
        check_speculation(0.0, args.num_speculative_tokens)
    else:
        check_speculation(args.acceptance_rate, args.num_speculative_tokens)
    return draft, args.acceptance_rate, args.num_speculative_tokens


def load_draft(path: str) -> "ModelSpec | DraftHead":
    """A draft head directory (kvlab.plan.draft_heads), else a draft model as MODEL arguments load."""
    return read_draft_head(path) or load_model(path)


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    spec = add_speculative_arguments(parser, "expected acceptance rate a, for the paper's speed-up")
    spec.add_argument("--verify-cost", type=float, default=1.0,
                      help="what verifying k + 1 tokens costs in plain decode steps (1: decode bound by weight reads, "
                           "as on a GPU; on a CPU measure it: kvlab bench speculative)")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--context", "--max-model-len", dest="context", type=positive_int, default=4096,
                          help="tokens per sequence (4096); with --engine vllm, its --max-model-len")
    workload.add_argument("--batch", type=positive_int, default=1, help="concurrent sequences (1)")
    workload.add_argument("--prompt-len", type=positive_int, help="prompt tokens for prefill time (= --context)")
    precision = parser.add_argument_group("precision")
    precision.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                           help="KV cache dtype, vLLM names plus int8/int4/int2 and KIVI (auto = --dtype)")
    precision.add_argument("--k-dtype", choices=KV_CACHE_DTYPES, help="K cache dtype (llama.cpp style)")
    precision.add_argument("--v-dtype", choices=KV_CACHE_DTYPES, help="V cache dtype (llama.cpp style)")
    precision.add_argument("--dtype", default="fp16", choices=MODEL_DTYPES, help="model dtype (fp16)")
    precision.add_argument("--kv-group-size", type=positive_int,
                           help="quantisation group size (int*: 64, KIVI: 32)")
    precision.add_argument("--kivi-residual", type=int, help="KIVI full-precision window R (128)")
    precision.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                           help="weight precision (auto = as the checkpoint ships: a GGUF's real bytes, a config's "
                                "quantization_config, else bf16)")
    hardware = parser.add_argument_group("memory and hardware")
    hardware.add_argument("--kv-cache-memory", type=byte_size, help="cache budget, e.g. 9GiB or 20GB")
    hardware.add_argument("--gpu", help="card(s) from the catalog (kvlab plan --list-gpus); several, e.g. "
                                        "h100,l40s,l4: which card and tensor-parallel size serve --context at --batch")
    hardware.add_argument("--memory-gib", type=positive_float, help="custom card: memory in GiB")
    hardware.add_argument("--bandwidth-gbs", type=positive_float, help="custom card: bandwidth in GB/s")
    hardware.add_argument("--tflops", type=positive_float, help="custom card: dense bf16 TFLOP/s")
    hardware.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9,
                          help="share of card memory for weights + cache (0.9)")
    hardware.add_argument("--tensor-parallel-size", type=positive_int,
                          help="ranks (1; with several --gpu cards, the smallest of 1, 2, 4, 8 that serves)")
    hardware.add_argument("--engine", choices=("kvlab", "vllm"), default="kvlab",
                          help="vllm: round to blocks and print vLLM's start-up lines")
    hardware.add_argument("--block-size", type=positive_int,
                          help="vLLM tokens per block (16; 128 with --vllm-device cpu; kvlab's engine 64)")
    hardware.add_argument("--vllm-device", choices=("cuda", "cpu"), default="cuda",
                          help="vLLM backend: cuda, or cpu (128-token blocks, budget from VLLM_CPU_KVCACHE_SPACE GiB "
                               "unless --kv-cache-memory is given)")
    hardware.add_argument("--max-num-batched-tokens", type=positive_int,
                          help="vLLM scheduler budget per step (vllm serve's default: 16384 on 160+ GiB cards, 8192 "
                               "on 70+ GiB but A100, else 2048; CPU 2048); sets windowed layers' reserve and the "
                               "profiled activation peak")
    hardware.add_argument("--max-num-seqs", type=positive_int,
                          help="vLLM's concurrent-sequence limit (vllm serve's default: 1024 on 70+ GiB cards, else "
                               "256; CPU 128); sizes the profiled sampler peak; with --engine kvlab, kvlab's "
                               "engine's seats (64), which hold KIVI's residuals and KVQuant's sinks and outliers")
    hardware.add_argument("--vllm-version", choices=tuple(RELEASES), default=DEFAULT_VERSION,
                          help=f"the vLLM release whose arithmetic and log lines to reproduce ({DEFAULT_VERSION}, "
                               "the one kvlab benchmarks; 0.19: releases before the logged-size change)")
    hardware.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                          help="vLLM with its hybrid manager off: windowed layers allocated as full attention")


def cards_from_args(args: argparse.Namespace) -> list[Device]:
    """The cards `--gpu` names (several with commas), or the custom card, or none."""
    custom = (args.memory_gib, args.bandwidth_gbs, args.tflops)
    if args.gpu and any(value is not None for value in custom):
        raise PlanError("give --gpu or --memory-gib/--bandwidth-gbs/--tflops, not both")
    if args.gpu:
        return devices(args.gpu)
    card = device_from_args(args)
    return [card] if card is not None else []


def device_from_args(args: argparse.Namespace) -> Device | None:
    custom = (args.memory_gib, args.bandwidth_gbs, args.tflops)
    if args.gpu and any(value is not None for value in custom):
        raise PlanError("give --gpu or --memory-gib/--bandwidth-gbs/--tflops, not both")
    if args.gpu:
        cards = devices(args.gpu)
        if len(cards) > 1:
            raise PlanError("several --gpu cards: this command plans one card")
        return cards[0]
    if any(value is not None for value in custom):
        if any(value is None for value in custom):
            raise PlanError("a custom card needs all of --memory-gib, --bandwidth-gbs and --tflops")
        return custom_device(*custom)
    return None


CPU_DEFAULT_KV_CACHE_SPACE = 4 * 2**30  # vLLM 0.19's CPU platform, when VLLM_CPU_KVCACHE_SPACE is unset or 0


def _cpu_kv_cache_space(args: argparse.Namespace) -> int | None:
    """The budget vLLM's CPU backend takes: --kv-cache-memory, else VLLM_CPU_KVCACHE_SPACE (GiB), as vLLM reads it.

    vLLM 0.32 (vllm/platforms/cpu.py, v1/worker/cpu_worker.py): a set variable is an integer number of GiB
    and is the budget exactly (0 leaves no cache, so vLLM refuses to start); unset, the worker takes
    --gpu-memory-utilization of its NUMA node's memory less what its own process already holds, a figure
    of the machine at start-up, so kvlab asks for one. vLLM 0.19 read unset or 0 as 4 GiB.
    """
    if args.vllm_device != "cpu":
        return args.kv_cache_memory
    if args.engine != "vllm":
        raise PlanError("--vllm-device cpu needs --engine vllm")
    if args.kv_cache_memory is not None:
        return args.kv_cache_memory
    legacy = args.vllm_version == "0.19"
    text = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not text and not legacy:
        raise PlanError("VLLM_CPU_KVCACHE_SPACE (GiB) is not set: vLLM 0.32's CPU backend then sizes its cache from "
                        "this machine's free memory at start-up; set it or give --kv-cache-memory")
    try:
        gib = int(text or "0")
    except ValueError:
        raise PlanError(f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got {text!r}") from None
    if gib < 0:
        raise PlanError(f"VLLM_CPU_KVCACHE_SPACE must be a positive number of GiB, got {gib}")
    if gib == 0 and not legacy:
        raise PlanError("VLLM_CPU_KVCACHE_SPACE=0 leaves vLLM 0.32's CPU backend no KV cache (it refuses to start)")
    if gib == 0:
        print("kvlab plan: warning: VLLM_CPU_KVCACHE_SPACE (GiB) is not set; vLLM 0.19's CPU backend then uses 4 GiB",
              file=sys.stderr)
        return CPU_DEFAULT_KV_CACHE_SPACE
    return gib * 2**30


def request_from_args(args: argparse.Namespace, card: Device | None = None) -> PlanRequest:
    """The plan request the flags describe (`card`: one of several --gpu cards, planned in turn)."""
    return PlanRequest(
        context=args.context, batch=args.batch, kv_cache_dtype=args.kv_cache_dtype, k_dtype=args.k_dtype,
        v_dtype=args.v_dtype, model_dtype=args.dtype, kv_group_size=args.kv_group_size,
        kivi_residual=args.kivi_residual, weight_dtype=args.weight_dtype, kv_cache_memory=_cpu_kv_cache_space(args),
        device=card or device_from_args(args), gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel=args.tensor_parallel_size or 1, prompt_len=args.prompt_len, engine=args.engine,
        block_size=args.block_size, vllm_device=args.vllm_device, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, vllm_hybrid=not args.disable_hybrid_kv_cache_manager,
        vllm_version=args.vllm_version,
        draft=load_draft(args.draft) if args.draft else None, acceptance_rate=args.acceptance_rate,
        num_speculative_tokens=args.num_speculative_tokens, verify_cost=args.verify_cost,
    )
