"""Change a model's number of KV heads: MHA -> GQA -> MQA and back (Ainslie et al., 2023).

Fewer heads: each new KV head replaces a group of old heads. `aligned` (the default) fits the
merge on calibration activations (kvlab.checkpoints.align: keys aligned by RoPE-commuting
rotations, values by their best summary, groups chosen by what they keep, output projection
refitted layer by layer, kvlab.checkpoints.layerwise); on SmolLM2-135M at 1 KV head it keeps
a usable model before any training. `mean` (the GQA paper's start for uptraining), `first`
and `random` (the baseline) pool consecutive heads from the weights alone. More heads: each head is repeated, which leaves the function unchanged, since query
head h keeps reading a copy of the head it read before. With groups == heads it is the
identity, and repeating then mean-pooling returns the original weights exactly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

METHODS = ("aligned", "mean", "first", "random")
WEIGHT_METHODS = METHODS[1:]  # need no calibration


def regroup_kv_rows(weight: torch.Tensor, head_dim: int, kv_heads: int, method: str = "mean",
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """K or V projection rows [old_heads * head_dim, ...] -> [kv_heads * head_dim, ...]."""
    if method not in WEIGHT_METHODS:
        raise PlanError(f"unknown weight-only KV-head conversion {method!r}; expected one of "
                        f"{', '.join(WEIGHT_METHODS)}")
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


def check_kv_heads(config, kv_heads: int) -> None:
    """One-line PlanErrors for a head count this model cannot be converted to, before any work."""
    if config.attention != "gqa":
        raise PlanError("--kv-heads converts grouped-query attention; this model uses MLA")
    if kv_heads <= 0 or config.n_heads % kv_heads:
        raise PlanError(f"--kv-heads {kv_heads} must be positive and divide the {config.n_heads} query heads")
    if kv_heads < config.kv_heads and config.kv_heads % kv_heads:
        raise PlanError(f"{config.kv_heads} KV heads cannot be pooled into {kv_heads} equal groups")
    if kv_heads > config.kv_heads and kv_heads % config.kv_heads:
        raise PlanError(f"{config.kv_heads} KV heads cannot be repeated into {kv_heads}")


def convert_kv_heads(model: Decoder, kv_heads: int, method: str = "mean", seed: int = 0,
                     calibration: Optional[torch.Tensor] = None, progress=None) -> Decoder:
    """A new model with `kv_heads` KV heads; the input model is left untouched.

    `aligned` needs `calibration`, token windows [n, T] (kvlab.checkpoints.calibration), and
    calls `progress(layer)` after each layer; with as many or more heads than the source every
    method is the same exact copy or repetition.
    """
    config = model.config
    check_kv_heads(config, kv_heads)
    if model.packing != "dense":
        raise PlanError(f"KV-head conversion averages weights and needs dense ones, not {model.packing}")
    if method not in METHODS:
        raise PlanError(f"unknown KV-head conversion {method!r}; expected one of {', '.join(METHODS)}")
    if method == "aligned" and kv_heads < config.kv_heads:
        return align_kv_heads(model, kv_heads, calibration, progress).model
    method = method if method in WEIGHT_METHODS else "mean"  # repeating: every method is the same copy
    generator = torch.Generator().manual_seed(seed)
    label = method if kv_heads < config.kv_heads else "repeated"
    new_config = replace(config.with_kv_heads(kv_heads), name=f"{config.name} [kv_heads={kv_heads}, {label}]")
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


def align_kv_heads(model: Decoder, kv_heads: int, calibration: Optional[torch.Tensor], progress=None):
    """The aligned merge (kvlab.checkpoints.align) to fewer heads, fitted layer by layer on
    `calibration`: a LayerwiseResult (the model, and per layer the groups and energy kept)."""
    from kvlab.checkpoints.align import choose_groups, merge_layer
    from kvlab.checkpoints.layerwise import convert_layerwise

    config = model.config
    if calibration is None:
        raise PlanError("--method aligned fits the merge on calibration text; none was given")
    if config.bias or config.qk_norm:
        raise PlanError("--method aligned merges keys linear in the input; this model has attention biases or "
                        "a q/k norm: use --method mean")
    heads, groups, d, dim = config.n_heads, config.kv_heads, config.head_size, config.dim
    new_config = replace(config.with_kv_heads(kv_heads), name=f"{config.name} [kv_heads={kv_heads}, aligned]")

    def fit(layer: int, attention, sigma: torch.Tensor):
        weight = attention.qkv.weight.detach().double()
        wq, wk, wv = weight.split((heads * d, groups * d, groups * d))
        wq, wk, wv = wq.view(heads, d, dim), wk.view(groups, d, dim), wv.view(groups, d, dim)
        wo = attention.o.weight.detach().double().view(-1, heads, d)
        chosen = choose_groups(wq, wk, wv, wo, sigma, kv_heads, config.rope_style)
        merged = merge_layer(wq, wk, wv, wo, sigma, chosen, config.rope_style)
        qkv = torch.cat((merged.wq.reshape(heads * d, dim), merged.wk.reshape(kv_heads * d, dim),
                         merged.wv.reshape(kv_heads * d, dim)))
        return ({"qkv.weight": qkv, "o.weight": merged.wo.reshape(-1, heads * d)},
                {"groups": chosen, "key_energy_kept": merged.key_kept, "value_energy_kept": merged.value_kept})

    return convert_layerwise(model, new_config, calibration, fit, progress=progress)
