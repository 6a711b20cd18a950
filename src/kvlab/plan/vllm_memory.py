"""vLLM's start-up memory on a GPU: what its worker subtracts before the KV cache, term by term.

`Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py, 0.32.0) computes

    available = total x --gpu-memory-utilization
                - (weights + non-torch memory + the profile run's transient activation peak)
                - CUDA-graph memory                           (profiled and subtracted since 0.21)

where `total` is what the CUDA runtime reports (kvlab.plan.hardware: `cuda_memory_bytes`), the
profile run is one forward pass over a dummy batch of `--max-num-batched-tokens` tokens and a
sampler pass over `--max-num-seqs` rows (`GPUModelRunner.profile_run`), and the CUDA-graph
term is the first capture plus a per-graph cost for every further capture size
(`profile_cudagraph_memory`). Which terms are exact and which are estimates:

- weights: exact, the checkpoint's tensors as loaded (kvlab.plan.quantized for quantised ones),
  per rank, plus vLLM's rotary cos/sin table (max positions x rotary dim in the model dtype:
  the 0.03 GiB by which Llama-3.1-8B's "Loading model weights took 14.99 GiB" exceeds its
  parameters).
- activation peak: estimate. The forward pass peaks inside the MLP, where the gate/up output,
  its activation and the residual stream live at once: tokens x dtype x (3 x intermediate / tp
  + 3 x hidden); a MoE layer holds top_k expert rows instead (fused-MoE's intermediate caches).
  The sampler holds each row's logits in the model dtype and in fp32 and its fp32
  probabilities, rows x vocab x 10 B (`_dummy_sampler_run`; on CUDA 0.32 samples with
  FlashInfer from the probabilities, and its native warm-up pass filters with Triton, neither
  sorting the vocabulary). The peak is the larger of the two. Calibrated on a published RTX 3090 log (vLLM issue 10517: Llama-3.1-8B,
  3.81 GiB available at 20,000 tokens and 2.89 GiB at 29,000, reproduced within 0.02 GiB).
- non-torch memory (cuBLAS workspaces, NCCL buffers): estimate, from published logs: 0.35 GiB
  on a 24 GiB card at TP 1 (issue 10517), 1.79 GiB on an H100 at TP 1 and 3.58 GiB per rank
  at TP 2 (vLLM PR 10511); kvlab takes the first below 40 GiB, the second above, the third at
  any TP > 1.
- CUDA graphs (0.32): estimate. The first capture holds the activations of the largest capture
  size; every further graph about 168 KiB per layer, calibrated on a published vLLM 0.21 log
  (LMCache issue 3430: Qwen3-8B, 51 + 35 graphs, "Estimated CUDA graph memory: 0.52 GiB").

The three published logs give, from kvlab's table: 3.82 / 2.90 GiB for the RTX 3090's 3.81 /
2.89, 53.70 GiB for the H100's 53.29 (PR 10511), 6.08 GiB for the Qwen3-8B's 6.37: within
0.42 GiB, which is the stated uncertainty of the estimates. vLLM's CPU backend subtracts none of
this: its budget is VLLM_CPU_KVCACHE_SPACE exactly.
"""

from __future__ import annotations

import math
from typing import Any

from kvlab.plan.hardware import Device
from kvlab.plan.spec import ModelSpec
from kvlab.plan.vllm_versions import VllmRelease

GIB = 2**30
SAMPLER_BYTES_PER_LOGIT = 10  # logits in the model dtype and in fp32, fp32 probabilities
GRAPH_BYTES_PER_LAYER = 168 * 2**10  # calibrated: (0.52 GiB - first capture) / (84 graphs x 36 layers)
NON_TORCH_SMALL, NON_TORCH_LARGE, NON_TORCH_TP = int(0.35 * GIB), int(1.79 * GIB), int(3.58 * GIB)
EXACT, ESTIMATE = "exact", "estimate"


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, blackwell: bool = False) -> tuple[list[int], int]:
    """(PIECEWISE capture sizes, number of FULL decode graphs) as vLLM 0.32's `_set_cudagraph_sizes` picks them."""
    largest = min(2 * max_num_seqs, 1024 if blackwell else 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= largest] + list(range(8, min(largest + 1, 256), 8)) + \
        list(range(256, largest + 1, 16))
    return sizes, len([s for s in sizes if s <= max_num_seqs])


def mlp_width(spec: ModelSpec) -> int:
    """The widest dense MLP: stated by a config.json, else what the parameter count leaves after attention and
    embeddings (presets and GGUF files state no width; an estimate)."""
    if spec.intermediate_size:
        return spec.intermediate_size
    hidden, params = spec.hidden_size or 0, spec.active_params or 0
    if not hidden or not params:
        return 0
    embeddings = (spec.vocab_size or 0) * hidden * (1 if spec.tied_embeddings else 2)
    attention = sum(hidden * layer.q_heads * layer.k_head_dim * 2 + hidden * layer.kv_heads * 2 * layer.k_head_dim
                    for layer in spec.layers)
    return max(0, (params - embeddings - attention) // (3 * hidden * spec.num_layers))


def forward_bytes_per_token(spec: ModelSpec, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """Activation bytes one token holds at the MLP's peak, on one rank (see the module docstring)."""
    hidden = spec.hidden_size or 0
    dense = 3 * mlp_width(spec) // tensor_parallel
    routed = 0
    if spec.experts_per_token and spec.expert_intermediate_size:
        routed = 3 * spec.experts_per_token * spec.expert_intermediate_size // tensor_parallel + \
            spec.experts_per_token * hidden
    return dtype_bytes * (max(dense, routed) + 3 * hidden)


def rotary_dim(spec: ModelSpec) -> int:
    first = spec.first_attention
    return first.qk_rope_head_dim if first.is_mla else first.k_head_dim


def startup_budget(spec: ModelSpec, card: Device, weights_per_rank: int, vllm: VllmRelease,
                   gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                   tensor_parallel: int = 1, dtype_bytes: int = 2) -> dict[str, Any]:
    """The budget table: total, requested, each subtracted term (exact or estimate), and what is left."""
    total = card.vllm_total_bytes
    requested = math.ceil(total * gpu_memory_utilization)
    per_token = forward_bytes_per_token(spec, dtype_bytes, tensor_parallel)
    forward = max_num_batched_tokens * per_token
    sampler = min(max_num_seqs, max_num_batched_tokens) * (spec.vocab_size or 0) * SAMPLER_BYTES_PER_LOGIT
    rotary = (spec.max_context or 0) * rotary_dim(spec) * dtype_bytes
    if tensor_parallel > 1:
        non_torch = NON_TORCH_TP
    else:
        non_torch = NON_TORCH_LARGE if total >= 40 * GIB else NON_TORCH_SMALL
    terms = [
        _term("weights", weights_per_rank + rotary, EXACT,
              "the checkpoint's tensors per rank" + (f" + rotary table {rotary:,} B" if rotary else "")),
        _term("activation peak", max(forward, sampler), ESTIMATE,
              f"max(forward {max_num_batched_tokens:,} tokens x {per_token:,} B, sampler "
              f"{min(max_num_seqs, max_num_batched_tokens):,} rows x vocab x {SAMPLER_BYTES_PER_LOGIT} B); "
              "calibrated on vLLM issue 10517"),
        _term("non-torch memory", non_torch, ESTIMATE,
              "published logs: 0.35 GiB (24 GiB card), 1.79 GiB (H100), 3.58 GiB per rank at TP 2"),
    ]
    if vllm.cudagraph_profiling:
        sizes, full = capture_sizes(max_num_seqs, max_num_batched_tokens, "b200" in card.name.lower())
        graphs = len(sizes) - 1 + max(full - 1, 0)
        graph_bytes = sizes[-1] * per_token + graphs * spec.num_layers * GRAPH_BYTES_PER_LAYER
        terms.append(_term("CUDA graphs", graph_bytes, ESTIMATE,
                           f"{len(sizes)} PIECEWISE + {full} FULL graphs: first capture at {sizes[-1]} tokens + "
                           f"{graphs} x {spec.num_layers} layers x 168 KiB; calibrated on LMCache issue 3430"))
    available = requested - sum(term["bytes"] for term in terms)
    return {"device": card.name, "total_bytes": total, "total_source": card.cuda_memory_source,
            "gpu_memory_utilization": gpu_memory_utilization, "requested_bytes": requested, "terms": terms,
            "available_bytes": available, "vllm_version": vllm.name,
            "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs}


def _term(name: str, num_bytes: int, kind: str, how: str) -> dict[str, Any]:
    return {"term": name, "bytes": int(num_bytes), "kind": kind, "how": how}
