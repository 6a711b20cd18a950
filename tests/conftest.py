"""Until kvlab.cache lands its factories, a float-only stand-in fills in (deleted once it does)."""

import torch

import kvlab.cache as kv


class _StandIn:
    def __init__(self, num_layers, batch, heads, dims, max_tokens, dtype, pre_rope=False, rope=None):
        self.num_layers, self.pre_rope, self.rope = num_layers, pre_rope, rope
        self.store = [[torch.zeros(batch, *([heads] if heads else []), max_tokens, d, dtype=dtype) for d in dims]
                      for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    def seq_len(self, layer_idx=0):
        return self.lengths[layer_idx]

    def update(self, layer_idx, *xs):
        start = self.lengths[layer_idx]
        end = start + xs[0].shape[-2]
        for buf, x in zip(self.store[layer_idx], xs):
            buf[..., start:end, :] = x
        self.lengths[layer_idx] = end
        out = [buf[..., :end, :] for buf in self.store[layer_idx]]
        if self.pre_rope:
            out[0] = self.rope(out[0], torch.arange(end))
        return tuple(out)

    def nbytes(self):
        return sum(t.nbytes for layer in self.store for t in layer)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _make_cache(kv_cache_dtype, num_layers, batch, kv_heads, k_head_dim, v_head_dim, max_tokens,
                compute_dtype=torch.float32, group_size=None, residual=None, paged=False, block_size=16,
                pre_rope=False, rope=None):
    dtype = compute_dtype if kv_cache_dtype == "auto" else _DTYPES[kv_cache_dtype]
    return _StandIn(num_layers, batch, kv_heads, (k_head_dim, v_head_dim), max_tokens, dtype, pre_rope, rope)


def _make_latent_cache(kv_cache_dtype, num_layers, batch, kv_lora_rank, rope_dim, max_tokens,
                       compute_dtype=torch.float32):
    dtype = compute_dtype if kv_cache_dtype == "auto" else _DTYPES[kv_cache_dtype]
    return _StandIn(num_layers, batch, 0, (kv_lora_rank, rope_dim), max_tokens, dtype)


if not hasattr(kv, "make_cache"):
    kv.make_cache = _make_cache
if not hasattr(kv, "make_latent_cache"):
    kv.make_latent_cache = _make_latent_cache
