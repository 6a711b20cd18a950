"""A KVQuant calibration for any model shape, fitted on random activations: what a KVQuant pool needs to exist
in tests that check layouts and paths, not quality (quality tests fit one on the model's own activations)."""

from __future__ import annotations

import torch

from kvlab.cache.kvquant_calibration import KVQuantCalibration, fit_layer


def random_calibration(config, tokens: int = 64, seed: int = 0) -> KVQuantCalibration:
    """Codebooks and key ranges for a kvlab.nn ModelConfig's layers, KV heads and head dim."""
    generator = torch.Generator().manual_seed(seed)
    shape = (config.kv_heads, tokens, config.head_size)
    layers = [fit_layer(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(config.n_layers)]
    return KVQuantCalibration(config.kv_heads, config.head_size, layers, {"random": True})
