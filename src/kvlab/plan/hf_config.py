"""Load a Hugging Face config.json into a `ModelSpec`, without transformers.

The planner must answer "how much KV cache per token?" for a model nobody has downloaded
yet, from its 2 KB config.json alone, so this reads the JSON with the stdlib and leaves
each family's quirks (defaults, legacy keys, window patterns, MLA, MoE) to
`kvlab.plan.hf_families` (and, for models whose layers differ in shape, `kvlab.plan.hf_mixed`).
Multimodal wrappers keep the language model under `text_config`: only the decoder is
planned. Every bad input, from a truncated file to a zero head count,
becomes one `PlanError` line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.hf_families import FAMILIES as _DECODERS
from kvlab.plan.hf_families import Family
from kvlab.plan.hf_mixed import MIXED_FAMILIES
from kvlab.plan.hf_fields import Fields
from kvlab.plan.hf_shape import Shape, count_params
from kvlab.plan.quantized import stored_weights
from kvlab.plan.spec import ModelSpec

CONFIG_NAME = "config.json"
FAMILIES: dict[str, Family] = _DECODERS | MIXED_FAMILIES
# wrappers whose text_config may omit its model_type: the decoder family they imply
WRAPPERS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "llama4": "llama4_text"}
SUPPORTED = ", ".join(sorted({name for name in FAMILIES if not name.startswith("RefinedWeb")} | set(WRAPPERS)))


def load_hf_config(path: str) -> ModelSpec:
    """Read a config.json (or a model directory holding one); the spec is named after its directory."""
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_NAME
    if not file.is_file():
        raise PlanError(f"no config.json at {path}")
    try:
        text = file.read_bytes().decode("utf-8")
        config = json.loads(text)
    except OSError as error:
        raise PlanError(f"cannot read {file}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise PlanError(f"{file} is not UTF-8 text, so not a config.json") from None
    except json.JSONDecodeError as error:
        hint = " (the file ends early: truncated?)" if error.pos >= len(error.doc.rstrip()) else ""
        raise PlanError(f"{file} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
                        f"{hint}") from None
    except RecursionError:
        raise PlanError(f"{file} nests too deeply to be a config.json") from None
    name = file.resolve().parent.name or file.stem
    return spec_from_hf_config(config, name)


def spec_from_hf_config(config: dict, name: str) -> ModelSpec:
    """Turn a parsed config.json into a spec: per-layer attention, parameter counts, context."""
    shape, notes = hf_shape(config)
    total, active = count_params(shape)
    stored = stored_weights(config, shape, _language_model(config)[0].get("model_type"), total)
    return ModelSpec(
        name=name,
        layers=shape.attention_layers(),
        params_total=total,
        params_active=active,
        hidden_size=shape.hidden,
        vocab_size=shape.vocab,
        tied_embeddings=shape.tied,
        max_context=shape.max_context,
        source="config.json",
        notes=notes + shape.notes,
        intermediate_size=max([shape.intermediate] + [m.intermediate for m in shape.mixers]),
        experts_per_token=shape.moe.top_k if shape.moe else None,
        expert_intermediate_size=shape.moe.expert_intermediate if shape.moe else None,
        weight_bytes=stored.bytes if stored else None,
        weight_format=stored.label if stored else None,
        checkpoint_bytes=stored.checkpoint_bytes if stored and stored.checkpoint_bytes != stored.bytes else None,
    )


def hf_shape(config: dict) -> tuple[Shape, tuple[str, ...]]:
    """The decoder's architecture facts from a parsed config.json (and notes on what was left out).

    The one reading of a config: the planner's spec and kvlab.checkpoints.hf's model config
    both start from this `Shape`.
    """
    if not isinstance(config, dict):
        raise PlanError(f"a config.json holds a JSON object, not {type(config).__name__}")
    config, notes = _language_model(config)
    model_type = config.get("model_type")
    family = _family(model_type)
    if family is None:
        stated = f"model_type {model_type!r}" if model_type is not None else "no model_type"
        raise PlanError(f"config.json has {stated}; supported families: {SUPPORTED}")
    shape = family.read(Fields(config, family.defaults, model_type))
    _check_heads(shape)
    return shape, notes


def _language_model(config: dict) -> tuple[dict, tuple[str, ...]]:
    """The decoder's own config: multimodal wrappers (Gemma 3, LLaVA-style) keep it under `text_config`."""
    model_type = config.get("model_type")
    text = config.get("text_config")
    wrapper = model_type if isinstance(model_type, str) else None
    if _family(model_type) or (text is None and wrapper not in WRAPPERS):
        return config, ()
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise PlanError("text_config must be a JSON object")
    inner: dict[str, Any] = dict(text)
    inner.setdefault("model_type", WRAPPERS.get(wrapper))
    if _family(inner["model_type"]) is None:
        return config, ()  # the error then names the wrapper's model_type
    if "tie_word_embeddings" in config:  # the wrapper's setting is the one its lm_head follows
        inner.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
    return inner, ("language model only: vision/audio towers and projectors are not counted",)


def _family(model_type: Any) -> Optional[Family]:
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def _check_heads(shape: Shape) -> None:
    if shape.latent is None and shape.q_heads % shape.kv_heads:
        raise PlanError(f"{shape.kv_heads} KV heads must divide the {shape.q_heads} attention heads")
