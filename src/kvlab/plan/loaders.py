"""One entry point from whatever the user typed to a `ModelSpec`: preset, config.json, GGUF or shape."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.presets import preset
from kvlab.plan.spec import ModelSpec, estimate_dense_params, uniform_layers


def load_model(reference: Optional[str]) -> ModelSpec:
    """A preset name, a config.json (file or directory) or a .gguf file."""
    if reference is None:
        raise PlanError("name a model (a preset, a config.json, a directory or a .gguf) or give --layers --heads "
                        "--kv-heads --head-dim")
    if reference.lower().endswith(".gguf"):
        from kvlab.plan.gguf_header import load_gguf_header
        if not os.path.isfile(reference):
            raise PlanError(f"no such GGUF file: {reference}")
        return load_gguf_header(reference)
    if os.path.isdir(reference) or reference.lower().endswith(".json") or os.path.isfile(reference):
        from kvlab.plan.hf_config import load_hf_config
        return load_hf_config(reference)
    return preset(reference)


def explicit_model(layers: int, heads: int, kv_heads: Optional[int], head_dim: Optional[int],
                   hidden: Optional[int] = None, params: Optional[int] = None, vocab: Optional[int] = None,
                   intermediate: Optional[int] = None) -> ModelSpec:
    """A dense model from `--layers --heads --kv-heads --head-dim [--hidden --params]`."""
    if head_dim is None:
        if hidden is None:
            raise PlanError("give --head-dim (or --hidden, from which head_dim = hidden / heads)")
        if hidden % heads:
            raise PlanError(f"--hidden {hidden} is not a multiple of --heads {heads}; give --head-dim")
        head_dim = hidden // heads
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads <= 0 or heads <= 0 or kv_heads > heads or heads % kv_heads:
        raise PlanError(f"--kv-heads {kv_heads} must be positive and divide --heads {heads}")
    spec = ModelSpec(f"custom-{layers}l-{heads}h-{kv_heads}kv-{head_dim}d",
                     uniform_layers(layers, heads, kv_heads, head_dim), hidden_size=hidden, vocab_size=vocab)
    if params is not None:
        return replace(spec, params_total=params)
    if hidden is not None:
        estimate = estimate_dense_params(layers, hidden, heads, kv_heads, head_dim, intermediate, vocab or 32000)
        return replace(spec, params_total=estimate, params_estimated=True)
    return spec
