"""The engine's knobs: vLLM's engine arguments with their CPU meaning, plus the seeds' max_wait_ms.

One dataclass read by `LLM(...)`, `kvlab serve` and the benchmarks alike (kvlab.commands.engine_args maps the
flags onto it), checked once here so a bad value is a one-line RequestError before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
from kvlab.engine.errors import RequestError
from kvlab.plan.pool_capacity import DEFAULT_MAX_NUM_SEQS
from kvlab.plan.units import parse_bytes

DEFAULT_MEMORY_FRACTION = 0.1  # of the machine's available memory, when no --kv-cache-memory is given


@dataclass
class EngineConfig:
    """vLLM's knobs (plus the seeds' max_wait_ms); see `kvlab serve --help`."""

    kv_cache_dtype: str = "auto"
    kv_cache_memory: Optional[Union[int, str]] = None  # bytes or "2GiB"; None: a share of available memory
    kv_cache_memory_fraction: float = DEFAULT_MEMORY_FRACTION
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None  # None: the model's own context length
    max_wait_ms: float = 0.0
    enable_prefix_caching: bool = True
    seed: int = 0
    paged_step: bool = True  # run steps in kvlab's C paged step where the model and pool allow
    speculative_config: object = None  # vLLM's speculative_config: a dict, its JSON text, or SpeculativeConfig
    kv_window: Optional[int] = None  # StreamingLLM's sinks + window policy: blocks out of the window are handed back
    sink_tokens: int = 0
    # vLLM's flags with their CPU meaning (kvlab.engine.memory_budget): the fraction of host memory kvlab may
    # use (weights included; the pool gets the rest), and one process (tensor / pipeline parallel 1)
    gpu_memory_utilization: Optional[float] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # kvquant3/kvquant4's codebooks and key ranges (`kvlab calibrate-kv`), as `kvlab eval --kv-calibration`
    kv_calibration: Optional[str] = None
    # keys cached before RoPE and rotated once read (`kvlab eval --pre-rope-keys`; KVQuant's always are)
    pre_rope_keys: bool = False

    def __post_init__(self) -> None:
        # LLM("smollm2-135m", kv_cache_memory="2GiB") reads as the CLI flag does; a bad size is
        # a one-line PlanError (a KvlabError), never a TypeError deep in the pool's sizing.
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if (self.kv_window is not None and self.kv_window <= 0) or self.sink_tokens < 0:
            raise RequestError(f"--kv-window must be positive and --sink-tokens non-negative, got "
                               f"{self.kv_window} and {self.sink_tokens}", "kv_window")
        if self.sink_tokens and self.kv_window is None:
            raise RequestError("--sink-tokens needs --kv-window", "sink_tokens")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}",
                               "gpu_memory_utilization")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise RequestError(f"--{name.replace('_', '-')} {getattr(self, name)}: kvlab runs the model in one "
                                   "CPU process, so only 1 is supported", name)


__all__ = ["DEFAULT_MEMORY_FRACTION", "EngineConfig"]
