"""The draft's shape: the target's tokenizer, vocabulary and RoPE, a few narrow layers, one KV head.

Speculative decoding pays per drafted token for a whole draft forward pass, and with a
49,152-token vocabulary the LM head dominates a small draft: [49152, dim] is 12.6M weights
at dim 256 against 7M for the rest of a 4-layer draft. So the drafts are narrow, with tied
embeddings, and MQA (one KV head of 64 channels) keeps their K/V, which shares the target's
pool, at 256 B per token per layer in fp16 (SmolLM2's 3 KV heads take 768).

The embeddings start as the target's own, projected onto their top principal directions
(a truncated SVD of SmolLM2's token_embd: E ~ U S V^T, the draft's table is U_d S_d), so the
draft's input and output vocabularies begin where the target's are, in d channels.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

HEAD_DIM = 64
SIZES = {  # name -> (dim, layers, query heads, ffn)
    "xs": (192, 2, 3, 512),
    "s": (256, 4, 4, 768),
    "tiny": (64, 1, 1, 64),  # for tests
}


def draft_config(target: ModelConfig, size: str) -> ModelConfig:
    """A draft of `size` for `target`: its vocabulary, RoPE, norm epsilon and context, MQA, tied embeddings."""
    if size not in SIZES:
        raise PlanError(f"unknown draft size {size!r}; choose one of {', '.join(SIZES)}")
    dim, layers, heads, ffn = SIZES[size]
    return ModelConfig(vocab_size=target.vocab_size, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=1,
                       head_dim=HEAD_DIM, ffn_dim=ffn, norm_eps=target.norm_eps, rope_base=target.rope_base,
                       rope_style=target.rope_style, max_seq_len=target.max_seq_len, tie_embeddings=True,
                       name=f"{target.name}-draft-{size}")


@torch.no_grad()
def embeddings_from_target(target_embed: torch.Tensor, dim: int) -> torch.Tensor:
    """The target's embedding table [V, D] on its top `dim` principal directions: [V, dim] = U_d S_d."""
    table = target_embed.detach().float()
    if dim > table.shape[1]:
        raise PlanError(f"a draft {dim} wide cannot start from a {table.shape[1]}-wide embedding")
    u, s, _ = torch.linalg.svd(table, full_matrices=False)
    return (u[:, :dim] * s[:dim]).contiguous()


def new_draft(target: Decoder, size: str, seed: int = 0) -> Decoder:
    """A fresh draft for `target` (GPT-2 initialisation, embeddings from the target's)."""
    torch.manual_seed(seed)
    config = draft_config(target.config, size)
    draft = Decoder(config)
    draft.embed.weight.data.copy_(embeddings_from_target(target.embed.weight, config.dim))
    return draft


def with_name(config: ModelConfig, name: str) -> ModelConfig:
    return replace(config, name=name)
