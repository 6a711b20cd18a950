"""A config-driven decoder: character GPTs, the Llama family, and MLA variants of either.

Data flows embed -> blocks (pre-norm attention, pre-norm MLP, residuals) -> norm -> LM head,
the same shape as nanoGPT's GPT. Positions come from the cache: a forward pass over T new
tokens on a cache already holding S tokens places them at S..S+T-1. Gemma 3 adds a scale on
the embeddings, norms on each sub-block's output, and a second RoPE table for its sliding layers.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from kvlab.cache.pooled_rows import PooledRows
from kvlab.nn.attention import Attention
from kvlab.nn.config import ModelConfig
from kvlab.nn.mla import MLA
from kvlab.nn.mlp import make_mlp
from kvlab.nn.norms import make_norm
from kvlab.nn.rope import RoPE
from kvlab.plan.errors import PlanError


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(config.norm, config.dim, config.norm_eps, config.bias)
        self.attn = MLA(config) if config.attention == "mla" else Attention(config, layer)
        self.mlp_norm = make_norm(config.norm, config.dim, config.norm_eps, config.bias)
        self.mlp = make_mlp(config.mlp, config.dim, config.ffn_size, config.bias)
        self.post_norms = config.post_norms
        if config.post_norms:  # Gemma's "sandwich": each sub-block's output normalised before the residual add
            self.post_attn_norm = make_norm(config.norm, config.dim, config.norm_eps, config.bias)
            self.post_mlp_norm = make_norm(config.norm, config.dim, config.norm_eps, config.bias)

    def forward(self, x: torch.Tensor, rope: RoPE, start: int, cache, layer: int, step=None) -> torch.Tensor:
        if step is None:
            attended = self.attn(self.attn_norm(x), rope, start, cache, layer)
        else:
            attended = self.attn(self.attn_norm(x), rope, start, cache, layer, step)
        if not self.post_norms:
            x = x + attended
            return x + self.mlp(self.mlp_norm(x))
        x = x + self.post_attn_norm(attended)
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, init_weights: bool = True):
        """`init_weights=False` leaves parameters as allocated: for loaders that overwrite them all."""
        super().__init__()
        self.config = config
        # A loader's embedding is left uninitialised: nn.Embedding's own normal_ init on the meta
        # device routes through torch._refs and imports torch._dynamo, 3 s of SmolLM2's start-up.
        unset = None if init_weights else torch.empty(config.vocab_size, config.dim)
        self.embed = nn.Embedding(config.vocab_size, config.dim, _weight=unset)
        with torch.device("cpu"):  # real tables even inside from_state_dict's meta-device build
            self.rope = RoPE(config.rope_dim, config.max_seq_len, config.rope_base, config.rope_style)
            self.rope_local = None  # sliding layers' own table (Gemma 3: base 10,000 against 1,000,000)
            if any(config.sliding_windows) and config.rope_local_base not in (None, config.rope_base):
                self.rope_local = RoPE(config.rope_dim, config.max_seq_len, config.rope_local_base, config.rope_style)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.norm = make_norm(config.norm, config.dim, config.norm_eps, config.bias)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if init_weights:
            self._init_parameters()

    def _init_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, residual projections scaled by depth."""
        config = self.config
        self.apply(self._init_weights)
        # GPT-2's scaled init: residual projections shrink with depth so the stream's variance stays put.
        for name, param in self.named_parameters():
            if name.endswith(("attn.o.weight", "mlp.down.weight", "mlp.proj.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: dict[str, torch.Tensor],
                        modules: Optional[dict[str, nn.Module]] = None) -> "Decoder":
        """A decoder that adopts `state`'s tensors, skipping random init (built on the meta device).

        `modules` replaces sub-modules by name (e.g. "blocks.0.attn.qkv" -> an Int4Linear) before loading.
        """
        modules = modules or {}
        with torch.device("meta"):  # no storage and no random init: every tensor comes from `state`
            model = cls(config, init_weights=False)
        for name, module in modules.items():
            model.set_submodule(name, module)
        result = model.load_state_dict(state, assign=True, strict=False)
        replaced = tuple(f"{name}." for name in modules)  # their tensors came with the modules
        missing = {key for key in result.missing_keys if not key.startswith(replaced)}
        if result.unexpected_keys or missing - ({"lm_head.weight"} if config.tie_embeddings else set()):
            raise PlanError(f"checkpoint tensors do not match the {config.name} config: {result}")
        if config.tie_embeddings and "lm_head" not in modules:
            model.lm_head.weight = model.embed.weight
        return model

    @property
    def packing(self) -> str:
        """How the big matrices are held: "dense", or a packed layer's kind ("gguf", "int4")."""
        kinds = {getattr(module, "packing", None) for module in self.modules() if module is not self} - {None}
        return "+".join(sorted(kinds)) or "dense"

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms'); big matrices may be stored narrower (bf16, int4)."""
        return self.norm.weight.dtype

    def forward(self, tokens: torch.Tensor, cache=None, last_only: bool = False, step=None,
                rows: Optional[torch.Tensor] = None, num_layers: Optional[int] = None, with_hidden: bool = False):
        """tokens [B,T] -> logits [B,T,vocab] (or [B,1,vocab] with `last_only`, all a sampler needs).

        With `step` (a kvlab.cache.StepBatch) tokens [1, N] are several sequences' new tokens
        packed in one row, `cache` is a kvlab.cache.KVPool, and `last_only` keeps each sequence's
        last token: logits [1, num_seqs, vocab]. `rows` picks packed positions explicitly (a
        speculative verification needs every drafted position). `num_layers` stops after that
        many blocks, then applies the final norm and LM head: the self-draft of speculative decoding.
        `with_hidden` returns (logits, hidden): hidden [B, T, dim] is every position's final hidden
        state after the final norm (what the LM head reads; the features a draft head drafts from).
        """
        if isinstance(cache, PooledRows):  # the lab's batch of rows on a pool: the engine's own step
            return self._rows_forward(tokens, cache, last_only, num_layers)
        start = cache.seq_len(0) if cache is not None and step is None else 0
        x = self.embed(tokens)
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)  # rounded to the dtype first, as Gemma does
        for layer, block in enumerate(self.blocks[:num_layers] if num_layers else self.blocks):
            x = block(x, self.rope_for(layer), start, cache, layer, step)
        if with_hidden:
            hidden = self.norm(x)
            picked = hidden[:, rows] if rows is not None else \
                (hidden[:, step.last_token_index()] if step is not None else hidden[:, -1:]) if last_only else hidden
            return self.lm_head(picked), hidden
        if rows is not None:
            x = x[:, rows]
        elif last_only:
            x = x[:, step.last_token_index()] if step is not None else x[:, -1:]
        return self.lm_head(self.norm(x))

    def _rows_forward(self, tokens: torch.Tensor, rows: PooledRows, last_only: bool,
                      num_layers: Optional[int]) -> torch.Tensor:
        """tokens [B, T] fed to B rows of a pool as one step (every row T new tokens): logits [B, T or 1, V]."""
        batch, new = tokens.shape
        step = rows.step(new)
        logits = self(tokens.reshape(1, batch * new), rows.pool, last_only=last_only, step=step, num_layers=num_layers)
        rows.advance(new)
        return logits.view(batch, 1 if last_only else new, -1)

    def rope_for(self, layer: int) -> RoPE:
        """The RoPE table layer `layer` rotates with."""
        if self.rope_local is not None and self.config.window_of(layer):
            return self.rope_local
        return self.rope

    def layer_ropes(self) -> list:
        """Each layer's rotation as a cache's `rope(x, positions)`: what a pre-RoPE cache applies on read."""
        return [self.rope_for(layer).at for layer in range(self.config.n_layers)]

    def new_cache(self, batch: int, max_tokens: int, kv_cache_dtype: str = "auto",
                  group_size: Optional[int] = None, residual: Optional[int] = None, pre_rope: bool = False,
                  kv_window: Optional[int] = None, sink_tokens: int = 0):
        """The lab's cache for `batch` rows of `max_tokens` tokens: the engine's paged pool, one block per
        row (kvlab.cache.PooledRows), so every command runs the formats, the step description and the
        forward the engine serves. KVQuant's formats (which need a calibration) and pre-RoPE keys get the
        lab's own cache (`reference_cache`), whose keys and values the pool's equal (tests/cache/test_kvquant_pool.py,
        tests/engine/test_engine_kvquant.py)."""
        if pre_rope or kv_cache_dtype.startswith("kvquant"):
            return self.reference_cache(batch, max_tokens, kv_cache_dtype, group_size, residual, pre_rope)
        return PooledRows.for_model(self.config, batch, max_tokens, kv_cache_dtype, self.dtype, group_size, residual,
                                    kv_window, sink_tokens)

    def reference_cache(self, batch: int, max_tokens: int, kv_cache_dtype: str = "auto",
                        group_size: Optional[int] = None, residual: Optional[int] = None, pre_rope: bool = False):
        """The lab's own cache of a format (kvlab.cache: contiguous, quantised, KIVI, window, MLA latent):
        written independently of the pool, it is what tests hold the pool to.

        A model with sliding layers gets a cache that drops what those layers no longer see
        (kvlab.cache.window), when its format is stored per token; other formats hold every
        token and the layers mask what is out of their window.
        """
        from kvlab import cache as kv
        from kvlab.plan.kv_formats import FLOAT, GROUP

        config = self.config
        if any(config.sliding_windows) and not pre_rope and \
                kv.kv_format(kv_cache_dtype, self.dtype, group_size, residual).scheme in (FLOAT, GROUP):
            from kvlab.cache.window import make_window_cache
            return make_window_cache(kv_cache_dtype, config.n_layers, batch, config.kv_heads, config.head_size,
                                     config.head_size, max_tokens, compute_dtype=self.dtype, group_size=group_size,
                                     layer_windows=config.sliding_windows)
        if config.attention == "mla":
            return kv.make_latent_cache(kv_cache_dtype, config.n_layers, batch, config.kv_lora_rank,
                                        config.rope_key_heads * config.qk_rope_head_dim, max_tokens,
                                        compute_dtype=self.dtype)
        return kv.make_cache(kv_cache_dtype, config.n_layers, batch, config.kv_heads, config.head_size,
                             config.head_size, max_tokens, compute_dtype=self.dtype, group_size=group_size,
                             residual=residual, pre_rope=pre_rope, rope=self.layer_ropes())
