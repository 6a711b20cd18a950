"""What the GQA study trains and measures: size presets, the four attention variants, settings.

Every variant is the same character GPT (nanoGPT's shape: pre-LayerNorm, GELU MLP, tied
embeddings, no biases) with RoPE instead of learned positions, so generation can run past
the training context while the cache grows. Only attention differs: 8 query heads over 8
(MHA), 2 (GQA) or 1 (MQA) KV heads, or MLA with a latent sized so its parameter count is
within 1% of MHA's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Optional

from kvlab.nn.config import ModelConfig
from kvlab.plan.errors import PlanError
from kvlab.train.loop import TrainConfig


@dataclass(frozen=True)
class Preset:
    """Model size, training budget and measurement sizes of one study configuration."""

    name: str
    n_layers: int
    n_heads: int
    dim: int
    block_size: int
    batch_size: int
    steps: int
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    eval_every: int = 100
    eval_batches: int = 8
    kv_heads: tuple[int, ...] = (8, 2, 1)
    decode_tokens: int = 2000
    decode_batches: tuple[int, ...] = (1, 32)
    decode_repeats: int = 3
    uptrain_fraction: float = 0.05
    uptrain_lr: float = 5e-4
    uptrain_evals: int = 10
    val_tokens: Optional[int] = None  # None: the whole validation split
    sample_chars: int = 300
    # torch threads. One by default: on a shared 2-core machine two threads stall badly whenever another
    # job holds a core (measured: up to 100x slower steps for small models), one thread does not.
    threads: Optional[int] = 1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def uptrain_steps(self) -> int:
        return max(1, round(self.steps * self.uptrain_fraction))


PRESETS = {
    # Sized so the whole study (8 runs, uptraining, decode timings) takes about an hour on 2 CPU cores.
    "default": Preset("default", n_layers=4, n_heads=8, dim=128, block_size=128, batch_size=32, steps=700,
                      warmup=70, eval_every=50),
    # The size (6 layers, 8 heads, 256 wide, 256 context): hours per model on 2 cores.
    "seed": Preset("seed", n_layers=6, n_heads=8, dim=256, block_size=256, batch_size=64, steps=5000,
                   warmup=200, eval_every=250, eval_batches=20, decode_repeats=5, threads=None),
    # The test suite's end-to-end check of the pipeline: seconds, not science.
    "quick": Preset("quick", n_layers=2, n_heads=8, dim=32, block_size=32, batch_size=8, steps=40, warmup=4,
                    eval_every=10, eval_batches=2, decode_tokens=48, decode_batches=(1, 4), decode_repeats=2,
                    uptrain_evals=2, val_tokens=4096, sample_chars=60),
}


@dataclass(frozen=True)
class Variant:
    name: str
    config: ModelConfig

    @property
    def kv_heads(self) -> Optional[int]:
        """KV heads cached per layer; None for MLA, which caches one latent row instead."""
        return None if self.config.attention == "mla" else self.config.kv_heads

    @property
    def cached_per_token_per_layer(self) -> int:
        """Elements one token adds to one layer's cache (K and V, or MLA's latent + RoPE key)."""
        c = self.config
        if c.attention == "mla":
            return c.kv_lora_rank + c.qk_rope_head_dim
        return 2 * c.kv_heads * c.head_size


def variant_name(kv_heads: int, n_heads: int) -> str:
    if kv_heads == n_heads:
        return "mha"
    return "mqa" if kv_heads == 1 else f"gqa-{kv_heads}"


def base_config(preset: Preset, vocab_size: int) -> ModelConfig:
    context = max(preset.block_size, preset.decode_tokens + 1)
    return ModelConfig(vocab_size=vocab_size, dim=preset.dim, n_layers=preset.n_layers, n_heads=preset.n_heads,
                       mlp="gelu", norm="layernorm", bias=False, tie_embeddings=True, rope_style="half",
                       max_seq_len=1 << (context - 1).bit_length(), name="char-gpt")


def variants(preset: Preset, vocab_size: int) -> list[Variant]:
    """MHA, GQA and MQA at `preset.kv_heads`, then MLA of about MHA's parameter count.

    MLA's shapes follow the head dim d: no-RoPE query/key part d, decoupled RoPE part d/2,
    value heads 3d/2 (so key and value widths match and training keeps SDPA's fused kernel)
    and a latent of dim/4. With d = 16 that is 791,936 parameters against MHA's 795,904.
    """
    base = base_config(preset, vocab_size)
    out = []
    for kv in preset.kv_heads:
        if preset.n_heads % kv:
            raise PlanError(f"{kv} KV heads must divide the {preset.n_heads} query heads")
        name = variant_name(kv, preset.n_heads)
        out.append(Variant(name, replace(base, n_kv_heads=kv, name=f"char-{name}")))
    d = preset.head_dim
    mla = replace(base, attention="mla", kv_lora_rank=max(2, preset.dim // 4), qk_nope_head_dim=d,
                  qk_rope_head_dim=max(2, d // 2), v_head_dim=d + max(2, d // 2), name="char-mla")
    out.append(Variant("mla", mla))
    return out


def train_config(preset: Preset, seed: int) -> TrainConfig:
    return TrainConfig(steps=preset.steps, batch_size=preset.batch_size, block_size=preset.block_size,
                       lr=preset.lr, min_lr=preset.min_lr, warmup=min(preset.warmup, preset.steps // 2),
                       eval_every=preset.eval_every, eval_batches=preset.eval_batches,
                       checkpoint_every=preset.eval_every, seed=seed)


def uptrain_config(preset: Preset, seed: int) -> TrainConfig:
    """5% of the original steps: short warm-up, cosine from `uptrain_lr` to the final pre-training rate."""
    steps = preset.uptrain_steps
    every = max(1, steps // preset.uptrain_evals)
    return TrainConfig(steps=steps, batch_size=preset.batch_size, block_size=preset.block_size,
                       lr=max(preset.uptrain_lr, preset.min_lr), min_lr=preset.min_lr, warmup=max(1, steps // 10),
                       eval_every=every, eval_batches=preset.eval_batches, checkpoint_every=every,
                       seed=10_000 + seed)  # fresh batches, not a replay of pre-training's first steps


def fingerprint(preset: Preset, data_sha256: str) -> str:
    """Short hash of everything that changes results: a run folder is reused only when it matches."""
    blob = json.dumps({"preset": asdict(preset), "data": data_sha256, "version": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]
