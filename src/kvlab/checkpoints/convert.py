"""Change a model's number of KV heads: MHA -> GQA -> MQA and back (Ainslie et al., 2023).

Fewer heads: each new KV head replaces a group of consecutive old heads, by the group's mean
(the paper's best start for uptraining), its first head, or a fresh random init (the
baseline). More heads: each head is repeated, which leaves the function unchanged, since query
head h keeps reading a copy of the head it read before. With groups == heads it is the
identity, and repeating then mean-pooling returns the original weights exactly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

METHODS = ("mean", "first", "random")


def regroup_kv_rows(weight: torch.Tensor, head_dim: int, kv_heads: int, method: str = "mean",
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """K or V projection rows [old_heads * head_dim, ...] -> [kv_heads * head_dim, ...]."""
    if method not in METHODS:
        raise PlanError(f"unknown KV-head conversion {method!r}; expected one of {', '.join(METHODS)}")
    old = weight.shape[0] // head_dim
    heads = weight.reshape(old, head_dim, *weight.shape[1:])
    if kv_heads == old:
        return weight.clone()
    if kv_heads > old:
        if kv_heads % old:
            raise PlanError(f"{old} KV heads cannot be repeated into {kv_heads}")
        return heads.repeat_interleave(kv_heads // old, dim=0).reshape(kv_heads * head_dim, *weight.shape[1:])
    if old % kv_heads:
        raise PlanError(f"{old} KV heads cannot be pooled into {kv_heads} equal groups")
    groups = heads.reshape(kv_heads, old // kv_heads, head_dim, *weight.shape[1:])
    if method == "mean":
        # In float64 the sum of n equal fp32/bf16 values is exact, so pooling copies returns them exactly.
        pooled = groups.double().mean(dim=1).to(weight.dtype)
    elif method == "first":
        pooled = groups[:, 0]
    else:
        noise = torch.randn(groups[:, 0].shape, generator=generator, dtype=torch.float32)
        pooled = (noise * weight.float().std()).to(weight.dtype)
    return pooled.reshape(kv_heads * head_dim, *weight.shape[1:])


def convert_kv_heads(model: Decoder, kv_heads: int, method: str = "mean", seed: int = 0) -> Decoder:
    """A new model with `kv_heads` KV heads; the input model is left untouched."""
    config = model.config
    if config.attention != "gqa":
        raise PlanError("--kv-heads converts grouped-query attention; this model uses MLA")
    if model.packing != "dense":
        raise PlanError(f"KV-head conversion averages weights and needs dense ones, not {model.packing}")
    if kv_heads <= 0 or config.n_heads % kv_heads:
        raise PlanError(f"--kv-heads {kv_heads} must be positive and divide the {config.n_heads} query heads")
    generator = torch.Generator().manual_seed(seed)
    new_config = replace(config.with_kv_heads(kv_heads), name=f"{config.name} [kv_heads={kv_heads}, {method}]")
    q, kv, d = config.n_heads * config.head_size, config.kv_heads * config.head_size, config.head_size
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}  # no storage shared
    for i in range(config.n_layers):
        for suffix in ("weight", "bias"):
            name = f"blocks.{i}.attn.qkv.{suffix}"
            if name not in state:
                continue
            wq, wk, wv = state[name].split((q, kv, kv))
            wk = regroup_kv_rows(wk, d, kv_heads, method, generator)
            wv = regroup_kv_rows(wv, d, kv_heads, method, generator)
            state[name] = torch.cat((wq, wk, wv))
    converted = Decoder.from_state_dict(new_config, state).to(model.dtype)
    return converted.train(model.training)
