"""The linear layers of a decoder, named as its checkpoint names them: what quantisers convert.

Weight-only quantisation (MXFP4, FP8 block scales, AWQ, GPTQ, compressed-tensors,
bitsandbytes) replaces the matrices of linear layers and keeps everything else (embeddings,
norms, biases, and whatever the config excludes) in the model dtype. To count a quantised
checkpoint's bytes we need each linear's shape, because scales go per group of input
columns or per 128 x 128 block, and its module name, because exclusions
(`modules_to_not_convert`, `ignore`) are patterns on names such as
"model.layers.*.self_attn" or "re:.*mlp.gate$".

Names follow the Hugging Face checkpoints of each family (experts under `mlp.experts.N`,
Mixtral's `block_sparse_moe.experts.N.w1`, gpt-oss's fused `mlp.experts.gate_up_proj`,
Llama 4's `feed_forward`). Layers whose projections a `Shape` does not spell out (Gemma 4's
and Qwen3-Next's mixers) are one linear holding the mixer's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kvlab.plan.hf_shape import Shape


@dataclass(frozen=True)
class Linear:
    """`count` matrices of `rows` x `cols` (out x in features) named `name` (experts share one entry)."""

    name: str
    rows: int
    cols: int
    count: int = 1
    router: bool = False  # a MoE router: most formats keep it in the model dtype

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


_MOE_NAMES = {  # model_type -> (mlp module, expert matrices, router, shared expert module)
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "gate", None),
    "phimoe": ("block_sparse_moe", ("w1", "w3", "w2"), "gate", None),
    "gpt_oss": ("mlp", None, "router", None),
    "llama4_text": ("feed_forward", None, "router", "shared_expert"),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate", "shared_experts"),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate", "shared_experts"),
}
_DEFAULT_MOE = ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate", "shared_expert")


def linear_layers(shape: Shape, model_type: str, prefix: str = "model.layers") -> Iterator[Linear]:
    """Every linear layer of the decoder, layer by layer, then the LM head (absent when tied)."""
    for index in range(shape.layers):
        base = f"{prefix}.{index}"
        yield from _attention(shape, index, base)
        yield from _mlp(shape, model_type, index, base)
    if not shape.tied:
        yield Linear("lm_head", shape.vocab, shape.hidden)


def _attention(s: Shape, index: int, base: str) -> Iterator[Linear]:
    if s.mixers:
        mixer = s.mixers[index]
        module = "linear_attn" if mixer.attention.is_state else "self_attn"
        yield Linear(f"{base}.{module}.proj", max(1, mixer.params // s.hidden), s.hidden)
        return
    attn = f"{base}.self_attn"
    if s.latent is not None:
        mla, heads = s.latent, s.q_heads
        q_width = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank:
            yield Linear(f"{attn}.q_a_proj", mla.q_lora_rank, s.hidden)
            yield Linear(f"{attn}.q_b_proj", q_width, mla.q_lora_rank)
        else:
            yield Linear(f"{attn}.q_proj", q_width, s.hidden)
        yield Linear(f"{attn}.kv_a_proj_with_mqa", mla.kv_lora_rank + mla.rope_key_heads * mla.qk_rope_head_dim,
                     s.hidden)
        yield Linear(f"{attn}.kv_b_proj", heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        yield Linear(f"{attn}.o_proj", s.hidden, heads * mla.v_head_dim)
        return
    q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    yield Linear(f"{attn}.q_proj", q, s.hidden)
    yield Linear(f"{attn}.k_proj", kv, s.hidden)
    yield Linear(f"{attn}.v_proj", kv, s.hidden)
    yield Linear(f"{attn}.o_proj", s.hidden, q)


def _mlp(s: Shape, model_type: str, index: int, base: str) -> Iterator[Linear]:
    moe = s.moe
    width = (s.mixers[index].intermediate if s.mixers else 0) or s.intermediate
    module, experts, router, shared = _MOE_NAMES.get(model_type, _DEFAULT_MOE)
    if moe is None or index in moe.dense_layers:
        yield from _dense(f"{base}.{module}", s.hidden, width, s.gated_mlp)
        return
    mlp, hidden, inner, count = f"{base}.{module}", s.hidden, moe.expert_intermediate, moe.experts
    yield Linear(f"{mlp}.{router}", count, hidden, router=True)
    if experts is None:  # fused across experts (gpt-oss, Llama 4): one tensor per matrix kind
        yield Linear(f"{mlp}.experts.gate_up_proj", (2 if s.gated_mlp else 1) * inner, hidden, count)
        yield Linear(f"{mlp}.experts.down_proj", hidden, inner, count)
    else:
        gate, up, down = experts
        if s.gated_mlp:
            yield Linear(f"{mlp}.experts.*.{gate}", inner, hidden, count)
        yield Linear(f"{mlp}.experts.*.{up}", inner, hidden, count)
        yield Linear(f"{mlp}.experts.*.{down}", hidden, inner, count)
    if moe.shared_intermediate:
        yield from _dense(f"{mlp}.{shared}", hidden, moe.shared_intermediate, s.gated_mlp)
        if moe.shared_gate:
            yield Linear(f"{mlp}.shared_expert_gate", 1, hidden, router=True)


def _dense(module: str, hidden: int, width: int, gated: bool) -> Iterator[Linear]:
    if gated:
        yield Linear(f"{module}.gate_proj", width, hidden)
    yield Linear(f"{module}.up_proj", width, hidden)
    yield Linear(f"{module}.down_proj", hidden, width)


def linear_params(shape: Shape, model_type: str) -> int:
    """Parameters held in linear layers (the rest: embeddings, norms, biases, sinks)."""
    return sum(linear.params for linear in linear_layers(shape, model_type))
