"""One KV setting under evaluation: cache dtype, pre-RoPE keys, KV-head or MLA conversion, window policy.

A setting is plain data with a stable `label`, so a results file can say which cells are done
and a re-run skips them; `build_model` and `new_cache` turn it into what the evals run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from kvlab.errors import KvlabError


class EvalError(KvlabError):
    """A setting or task that cannot be evaluated as asked (a user's mistake)."""


@dataclass(frozen=True)
class KVSetting:
    kv_cache_dtype: str = "auto"
    pre_rope: bool = False  # keys cached before RoPE (KVQuant's per-channel keys; kvquant* implies it)
    kv_heads: Optional[int] = None  # convert the model to this many KV heads first (None: as loaded)
    method: str = "mean"  # the conversion: mean, first or random (kvlab.checkpoints.convert)
    window: Optional[int] = None  # StreamingLLM: keep the newest `window` tokens ...
    sinks: int = 0  # ... and the first `sinks` tokens (attention sinks)
    mla_rank: Optional[int] = None  # convert to MLA (kvlab.checkpoints.mla) with this latent rank ...
    mla_rope: int = 0  # ... and this many RoPE channels per source KV head
    # the converted model was then uptrained this many steps (`kvlab uptrain`): a label only, since
    # the weights come from that run's directory, which the caller loads and evaluates
    uptrain_steps: int = 0

    def __post_init__(self) -> None:
        if self.window is not None and self.window <= 0:
            raise EvalError(f"--kv-window must be positive, got {self.window}")
        if self.sinks < 0:
            raise EvalError(f"--sink-tokens must be non-negative, got {self.sinks}")
        if self.sinks and self.window is None:
            raise EvalError("--sink-tokens needs --kv-window")
        if self.window is not None and (self.is_kvquant or self.kv_cache_dtype.startswith("kivi")):
            raise EvalError(f"--kv-window hands back whole blocks of per-token rows; {self.kv_cache_dtype} is not "
                            "stored that way")
        if self.uptrain_steps and self.kv_heads is None:
            raise EvalError("uptrain_steps labels an uptrained KV-head conversion; set kv_heads too")
        if self.mla_rank is not None and (self.kv_heads is not None or self.pre_rope or self.is_kvquant):
            raise EvalError("an MLA conversion caches a latent: it does not combine with KV-head conversions, "
                            "pre-RoPE keys or KVQuant")

    @property
    def label(self) -> str:
        """A short, stable name: 'int4', 'int4+prerope', 'fp16 kvh1-mean', 'fp16 kvh1-mean+uptrain300',
        'fp16 sink4+win256', 'fp16 mla-r192-rope32'."""
        parts = [self.kv_cache_dtype + ("+prerope" if self.pre_rope and not self.is_kvquant else "")]
        if self.kv_heads is not None:
            parts.append(f"kvh{self.kv_heads}-{self.method}" + (f"+uptrain{self.uptrain_steps}" if self.uptrain_steps else ""))
        if self.window is not None:
            parts.append(f"sink{self.sinks}+win{self.window}")
        if self.mla_rank is not None:
            parts.append(f"mla-r{self.mla_rank}-rope{self.mla_rope}")
        return " ".join(parts)

    @property
    def in_paged_pool(self) -> bool:
        """Whether the eval runs on the engine's paged pool (kvlab.cache.PooledRows: its bytes and forward):
        every setting but KVQuant's and pre-RoPE keys, which run on the lab's own caches; the engine serves
        those too, holding the same keys and values (tests/engine/test_engine_kvquant.py)."""
        return not (self.pre_rope or self.is_kvquant)

    @property
    def is_kvquant(self) -> bool:
        return self.kv_cache_dtype.startswith("kvquant")

    def as_dict(self) -> dict:
        return asdict(self)


def build_model(loaded, setting: KVSetting, seed: int = 0):
    """The loaded model, converted in memory to `setting.kv_heads` when asked."""
    model = loaded.model
    if setting.kv_heads is not None and setting.kv_heads != model.config.kv_heads:
        from kvlab.checkpoints.convert import convert_kv_heads
        model = convert_kv_heads(model, setting.kv_heads, setting.method, seed)
    if setting.mla_rank is not None:
        from kvlab.checkpoints.mla import convert_to_mla
        model = convert_to_mla(model, setting.mla_rank, setting.mla_rope).model
    return model.eval()


def new_cache(model, setting: KVSetting, max_tokens: int, calibration=None):
    """A batch-1 cache for `model` under `setting`: the engine's pool (its formats, its sinks + window
    policy) where it stores the setting; the lab's own caches for KVQuant (which needs its
    `calibration`) and pre-RoPE keys."""
    if setting.is_kvquant:
        from kvlab.cache.kvquant import make_kvquant_cache
        if calibration is None:
            raise EvalError(f"{setting.kv_cache_dtype} needs a calibration: run `kvlab calibrate-kv MODEL --data FILE`")
        return make_kvquant_cache(setting.kv_cache_dtype, calibration, 1, max_tokens, model.dtype, model.layer_ropes())
    if setting.window is not None and setting.pre_rope:
        raise EvalError("--kv-window keeps rotated keys; it does not combine with --pre-rope-keys")
    return model.new_cache(1, max_tokens, setting.kv_cache_dtype, pre_rope=setting.pre_rope, kv_window=setting.window,
                           sink_tokens=setting.sinks)
