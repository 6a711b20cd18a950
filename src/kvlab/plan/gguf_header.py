"""Load a GGUF file's header into a `ModelSpec`: shapes from metadata, sizes from tensor records.

A GGUF states its architecture in `{arch}.*` keys and lists every tensor with its type and
shape, so the header alone gives exact parameter counts and the exact bytes llama.cpp will
load, without reading a byte of weights. The header comes from kvlab.plan.gguf_file's stdlib
reader, which skips the vocabulary, so planning a 100 MB file takes milliseconds and
`import kvlab.plan` stays stdlib-only.

Window conventions follow llama.cpp, which is what runs a GGUF: a bare
`attention.sliding_window` applies with the architecture's built-in layer pattern (Gemma 2
and gpt-oss alternate, Gemma 3 keeps every 6th layer global), and Phi-3's window is ignored
because llama.cpp runs Phi-3 with full attention (ggml-org/llama.cpp#13676).
"""

from __future__ import annotations

from collections import Counter

import os
from pathlib import Path
from typing import Any, Optional, Union

from kvlab.plan.errors import PlanError
from kvlab.plan.gguf_file import GGUFHeader, TensorInfo, read_gguf_header
from kvlab.plan.spec import FULL, MLA, SLIDING, LayerAttention, ModelSpec

# llama.cpp's set_swa_pattern(n): layer i slides unless i % n == n - 1 (n = 0: every layer slides)
_SWA_PERIOD = {"gemma2": 2, "gpt-oss": 2, "cohere2": 4, "olmo2": 4, "exaone4": 4, "gemma3": 6}
_SWA_IGNORED = {"phi3"}
_NOT_PARAMETERS = ("rope_freqs.", "rope_factors_")  # rotary tables stored as tensors


def _widest(value) -> Optional[int]:
    """`feed_forward_length`: one width, or one per layer (some architectures): the widest, or None."""
    widths = value if isinstance(value, list) else [value]
    widths = [w for w in widths if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return max(widths) if widths else None


def load_gguf_header(path: Union[str, os.PathLike]) -> ModelSpec:
    """Read a .gguf header: per-layer attention, parameter counts and the file's real weight bytes."""
    return spec_from_gguf_header(read_gguf_header(path))


def spec_from_gguf_header(header: GGUFHeader) -> ModelSpec:
    """The planner's model from a parsed header (the loaders build their config from this too)."""
    meta = GGUFMetadata(header.metadata)
    arch = meta.text("general.architecture")
    notes: list[str] = []
    layers = _layers(meta, arch, notes)
    tensors = header.tensors
    total, active = _count_params(meta, arch, list(tensors.values()))
    embedding = tensors.get("token_embd.weight")
    vocab = embedding.dims[1] if embedding is not None and len(embedding.dims) == 2 else _vocab(meta, arch)
    return ModelSpec(
        name=Path(header.path).stem,  # what the user typed; general.name is often generic ("llama")
        layers=layers,
        params_total=total,
        params_active=active,
        hidden_size=meta.size(f"{arch}.embedding_length"),
        vocab_size=vocab,
        tied_embeddings="output.weight" not in tensors,
        max_context=meta.optional_size(f"{arch}.context_length"),
        weight_bytes=header.weight_bytes,
        weight_format="GGUF tensors: " + ", ".join(f"{count} {kind}" for kind, count in Counter(
            tensor.type_name for tensor in tensors.values()).most_common()),
        intermediate_size=_widest(meta.get(f"{arch}.feed_forward_length")),
        source="gguf",
        notes=tuple(notes),
    )


class GGUFMetadata:
    """Typed access to GGUF key-values, each failure a one-line `PlanError`."""

    def __init__(self, metadata: dict) -> None:
        self.metadata = metadata

    def get(self, key: str) -> Any:
        return self.metadata.get(key)

    def number(self, key: str, default: float) -> float:
        """A float setting (norm epsilon, RoPE base), `default` where the file states none."""
        value = self.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise PlanError(f"GGUF key {key} must be a positive number, got {value!r}")
        return float(value)

    def text(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value:
            raise PlanError(f"GGUF header lacks {key}")
        return value

    def optional_size(self, key: str) -> Optional[int]:
        value = self.get(key)
        if value is None:
            return None
        if not _is_int(value) or value <= 0:
            raise PlanError(f"GGUF key {key} must be a positive integer, got {value!r}")
        return value

    def size(self, key: str) -> int:
        value = self.optional_size(key)
        if value is None:
            raise PlanError(f"GGUF header lacks {key}")
        return value

    def per_layer(self, key: str, layers: int, default: Optional[list[int]] = None) -> list[int]:
        """A count stated once for all layers or as one entry per layer (0: no attention there)."""
        value = self.get(key)
        if value is None:
            if default is None:
                raise PlanError(f"GGUF header lacks {key}")
            return default
        values = value if isinstance(value, list) else [value] * layers
        if len(values) != layers or not all(_is_int(item) and item >= 0 for item in values):
            raise PlanError(f"GGUF key {key} must be a non-negative count or one per layer ({layers})")
        return values


def _layers(meta: GGUFMetadata, arch: str, notes: list[str]) -> tuple[LayerAttention, ...]:
    count = meta.size(f"{arch}.block_count")
    heads = meta.per_layer(f"{arch}.attention.head_count", count)
    kv_heads = meta.per_layer(f"{arch}.attention.head_count_kv", count, default=heads)
    first = next((h for h in heads if h), 0)
    if not first:
        raise PlanError("the GGUF header gives no layer any attention heads")
    hidden = meta.size(f"{arch}.embedding_length")
    key_dim = meta.optional_size(f"{arch}.attention.key_length") or hidden // first
    value_dim = meta.optional_size(f"{arch}.attention.value_length") or key_dim
    sliding = _sliding_layers(meta, arch, count, notes)
    window = meta.optional_size(f"{arch}.attention.sliding_window")
    swa_key = meta.optional_size(f"{arch}.attention.key_length_swa") or key_dim
    swa_value = meta.optional_size(f"{arch}.attention.value_length_swa") or value_dim
    lora = meta.optional_size(f"{arch}.attention.kv_lora_rank")
    layers = []
    for index in range(count):
        if not heads[index] or not kv_heads[index]:
            continue  # a recurrent or attention-free block: it holds no KV cache
        if lora:
            # DeepSeek-style MLA; newer GGUFs store the absorbed dims and keep the real ones in *_mla
            rope = meta.optional_size(f"{arch}.rope.dimension_count") or 0
            layers.append(LayerAttention(MLA, heads[index], heads[index],
                                         meta.optional_size(f"{arch}.attention.key_length_mla") or key_dim,
                                         meta.optional_size(f"{arch}.attention.value_length_mla") or value_dim,
                                         kv_lora_rank=lora, qk_rope_head_dim=rope))
        elif heads[index] % kv_heads[index]:
            raise PlanError(f"layer {index}: {kv_heads[index]} KV heads must divide its {heads[index]} attention heads")
        elif sliding[index]:
            layers.append(LayerAttention(SLIDING, heads[index], kv_heads[index], swa_key, swa_value, window=window))
        else:
            layers.append(LayerAttention(FULL, heads[index], kv_heads[index], key_dim, value_dim))
    if len(layers) < count:
        notes.append(f"{count - len(layers)} of {count} blocks have no attention and hold no KV cache")
    return tuple(layers)


def _sliding_layers(meta: GGUFMetadata, arch: str, count: int, notes: list[str]) -> list[bool]:
    """Which layers use `attention.sliding_window`: an explicit pattern, else llama.cpp's per-arch rule."""
    if not meta.optional_size(f"{arch}.attention.sliding_window"):
        return [False] * count
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != count:
            raise PlanError(f"GGUF key {arch}.attention.sliding_window_pattern must list all {count} layers")
        return [bool(item) for item in pattern]
    if pattern is None and arch in _SWA_IGNORED:
        notes.append(f"{arch}.attention.sliding_window ignored: llama.cpp runs {arch} with full attention")
        return [False] * count
    if pattern is None and arch not in _SWA_PERIOD:
        notes.append(f"no sliding-window pattern known for {arch}: assumed on every layer")
    period = _SWA_PERIOD.get(arch, 0) if pattern is None else pattern
    if not _is_int(period) or period < 0:
        raise PlanError(f"GGUF key {arch}.attention.sliding_window_pattern is malformed: {pattern!r}")
    return [period == 0 or index % period < period - 1 for index in range(count)]


def _count_params(meta: GGUFMetadata, arch: str, tensors: list[TensorInfo]) -> tuple[int, Optional[int]]:
    """(total, active) elements over the weight tensors; active drops the experts a token skips."""
    weights = [tensor for tensor in tensors if not tensor.name.startswith(_NOT_PARAMETERS)]
    total = sum(tensor.n_elements for tensor in weights)
    experts = meta.optional_size(f"{arch}.expert_count")
    used = meta.optional_size(f"{arch}.expert_used_count")
    if not experts or not used:
        return total, None
    routed = sum(tensor.n_elements for tensor in weights if "_exps." in tensor.name)
    return total, total - routed // experts * (experts - min(used, experts))


def _vocab(meta: GGUFMetadata, arch: str) -> Optional[int]:
    tokens = meta.get("tokenizer.ggml.tokens")
    return meta.optional_size(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
