"""Multi-head latent attention (DeepSeek-V2) with decoupled RoPE.

Each token is compressed to a latent c = norm(x W_dkv) of `kv_lora_rank` channels plus
decoupled RoPE keys; only (c, k_rope) are cached. Per head h the keys and values are
up-projections of the latent, k_h = [c W_uk_h^T, k_rope_g(h)], v_h = c W_uv_h^T.

DeepSeek-V2 has one RoPE key shared by all heads (`rope_key_heads=1`). A GQA model converted
exactly (kvlab.checkpoints.mla) keeps one per source KV head: query head h reads RoPE key
g(h) = h // (heads / rope_key_heads), the same grouping as GQA, and the latent norm is
optional (`latent_norm`) because a conversion has nothing to normalise.

Two ways to decode, equal in exact arithmetic:
- naive: up-project the whole cached latent into per-head K and V, then attend;
- absorbed: fold W_uk into the query (q_h W_uk_h lives in latent space) and W_uv into the
  output, so attention runs directly over the cached latent: it is GQA with `rope_key_heads`
  KV "heads" [c, k_rope_g] of width rank + rope_dim whose values are c itself (MQA for
  DeepSeek's one shared key).
The scores keep the scale 1/sqrt(nope + rope) of the un-absorbed heads.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvlab.nn.attention import attend
from kvlab.nn.config import ModelConfig
from kvlab.nn.norms import RMSNorm
from kvlab.nn.rope import RoPE


class MLA(nn.Module):
    def __init__(self, config: ModelConfig, absorb: bool = False):
        super().__init__()
        self.n_heads = config.n_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_dim = config.kv_lora_rank, config.v_head_dim
        self.rope_heads = config.rope_key_heads
        self.scale = 1.0 / math.sqrt(self.nope + self.rope_dim)
        self.absorb = absorb
        self.wq = nn.Linear(config.dim, self.n_heads * (self.nope + self.rope_dim), bias=False)
        # W_dkv and the RoPE key(s)
        self.wkv_a = nn.Linear(config.dim, self.rank + self.rope_heads * self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.rank, config.norm_eps) if config.latent_norm else nn.Identity()
        self.wkv_b = nn.Linear(self.rank, self.n_heads * (self.nope + self.v_dim), bias=False)  # W_uk, W_uv
        self.o = nn.Linear(self.n_heads * self.v_dim, config.dim, bias=False)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, rank] and W_uv [H, v_dim, rank], views of `wkv_b`."""
        w = self.wkv_b.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, rope: RoPE, start: int = 0, cache=None, layer: int = 0,
                step=None) -> torch.Tensor:
        """x [B,T,dim]; `cache` (a kvlab.cache.LatentCache) grows by T latent rows of rank + keys * rope.

        With `step` (a kvlab.cache.StepBatch), x [1, N, dim] is several sequences' new tokens packed
        in one row and `cache` is an MLA KVPool, whose rows are the same latent rows.
        """
        if step is not None:
            return self._forward_step(x, rope, cache, layer, step)
        batch, new, _ = x.shape
        q = self.wq(x).view(batch, new, self.n_heads, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split((self.nope, self.rope_dim), dim=-1)
        q_rope = rope(q_rope, start)
        latent, k_rope = self.wkv_a(x).split((self.rank, self.rope_heads * self.rope_dim), dim=-1)
        latent = self.kv_norm(latent)
        # [B,G,T,rope]: RoPE only needs positions on the second-last axis; rows go back to [B,T,G*rope]
        k_rope = rope(k_rope.view(batch, new, self.rope_heads, self.rope_dim).transpose(1, 2), start)
        k_rope = k_rope.transpose(1, 2).reshape(batch, new, self.rope_heads * self.rope_dim)
        if cache is not None:
            latent, k_rope = cache.update(layer, latent, k_rope)
        k_rope = k_rope.view(batch, -1, self.rope_heads, self.rope_dim).transpose(1, 2)  # [B,G,S,rope]
        if self.absorb:
            y = self.absorbed(q_nope, q_rope, latent, k_rope)
        else:
            y = self.naive(q_nope, q_rope, latent, k_rope)
        return self.o(y.transpose(1, 2).reshape(batch, new, self.n_heads * self.v_dim))

    def _forward_step(self, x: torch.Tensor, rope: RoPE, pool, layer: int, step) -> torch.Tensor:
        """The packed, paged path: one projection for every sequence's tokens, attention per sequence."""
        tokens = x.shape[1]
        q = self.wq(x[0]).view(tokens, self.n_heads, self.nope + self.rope_dim).transpose(0, 1)  # [H, N, d]
        q_nope, q_rope = q.split((self.nope, self.rope_dim), dim=-1)
        q_rope = rope.at(q_rope, step.positions)
        latent, k_rope = self.wkv_a(x[0]).split((self.rank, self.rope_heads * self.rope_dim), dim=-1)
        k_rope = rope.at(k_rope.view(tokens, self.rope_heads, self.rope_dim).transpose(0, 1), step.positions)
        rows = torch.cat((self.kv_norm(latent), k_rope.transpose(0, 1).reshape(tokens, -1)), dim=-1)
        pool.store(layer, rows[:, None], None, step)
        outs, at = [], 0
        for s, new in enumerate(step.query_lens):
            held, _, mask = pool.attention_inputs(layer, step, s)  # [1, held, rank + keys * rope]
            cached, cached_rope = held[0].split((self.rank, self.rope_heads * self.rope_dim), dim=-1)
            cached_rope = cached_rope.view(-1, self.rope_heads, self.rope_dim).transpose(0, 1)[None]
            attend_latent = self.absorbed if self.absorb else self.naive
            outs.append(attend_latent(q_nope[None, :, at:at + new], q_rope[None, :, at:at + new], cached[None],
                                      cached_rope, mask)[0])
            at += new
        y = torch.cat(outs, dim=1)  # [H, N, v_dim]
        return self.o(y.transpose(0, 1).reshape(1, tokens, self.n_heads * self.v_dim))

    def naive(self, q_nope, q_rope, latent, k_rope, mask=None) -> torch.Tensor:
        """Up-project the latent into per-head keys and values, then ordinary attention."""
        w_uk, w_uv = self.up_weights()
        k_nope = torch.einsum("btr,hdr->bhtd", latent, w_uk)
        v = torch.einsum("btr,hdr->bhtd", latent, w_uv)
        k_rope = k_rope.repeat_interleave(self.n_heads // self.rope_heads, dim=1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        return attend(q, k, v, scale=self.scale, mask=mask)

    def absorbed(self, q_nope, q_rope, latent, k_rope, mask=None) -> torch.Tensor:
        """Attend in latent space: W_uk folded into the query, W_uv applied after."""
        w_uk, w_uv = self.up_weights()
        q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)
        q = torch.cat((q_latent, q_rope), dim=-1)
        groups = k_rope.shape[1]
        k = torch.cat((latent[:, None].expand(-1, groups, -1, -1), k_rope), dim=-1)  # one head per RoPE key
        # The values are the latent, the keys' first `rank` channels: passing the keys as values and
        # dropping the RoPE channels after keeps q, k and v one width, which SDPA's fused CPU kernel
        # needs (with a narrower v it falls back to a math path that copies K/V per head: 4-5x slower).
        out_latent = attend(q, k, k, scale=self.scale, mask=mask)[..., : self.rank]
        return torch.einsum("bhtr,hdr->bhtd", out_latent, w_uv)
