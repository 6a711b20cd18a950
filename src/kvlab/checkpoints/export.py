"""`kvlab convert`'s work: load any checkpoint, change its KV heads, write it where others load it.

The output is a Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) that transformers
opens offline, plus, with `gguf=True`, a `model.gguf` llama.cpp loads. Everything is
written into a temporary directory beside OUT and renamed to OUT at the end, so a failed or
interrupted conversion leaves nothing behind (and an existing OUT untouched unless
`force`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from kvlab.cache.base import TORCH_DTYPES
from kvlab.checkpoints.tokenizer import Tokenizer
from kvlab.files import write_directory
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

GGUF_NAME = "model.gguf"


@dataclass
class Source:
    """A loaded checkpoint, dense, with what an export copies from its file."""

    model: Decoder
    tokenizer: Optional[Tokenizer]
    path: str
    tokenizer_metadata: Optional[dict[str, Any]]  # a GGUF source's tokenizer.* keys
    stored_dtype: str = "fp32"  # how the file stores its matrices: fp32, or bf16 for anything narrower


def output_dtype(requested: str, source: Source) -> torch.dtype:
    """--dtype: `auto` writes what the source ships (bf16 unless it stores fp32 matrices, like stories260K)."""
    return TORCH_DTYPES[source.stored_dtype if requested == "auto" else requested]


def load_source(name: str) -> Source:
    """A model name, .gguf file, HF directory or kvlab training checkpoint (.pt), in fp32."""
    if name.lower().endswith(".pt"):
        return _training_checkpoint(name)
    from kvlab.checkpoints.resolve import load_checkpoint, resolve_model_path

    path = resolve_model_path(name)
    loaded = load_checkpoint(path, torch.float32, "dense")
    metadata, stored = None, "fp32"
    if not os.path.isdir(path):
        from kvlab.plan.gguf_file import read_gguf_header
        header = read_gguf_header(path, strings=True)
        metadata = {k: v for k, v in header.metadata.items() if k.startswith("tokenizer.")}
        matrices = [t for t in header.tensors.values() if len(t.dims) == 2]
        stored = "fp32" if all(t.type_name == "F32" for t in matrices) else "bf16"
    else:
        stored = _hf_stored_dtype(path)
    return Source(loaded.model, loaded.tokenizer, path, metadata, stored)


def _hf_stored_dtype(directory: str) -> str:
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
            data = json.load(handle)
        name = data.get("torch_dtype") or data.get("dtype")
    except (OSError, ValueError, AttributeError):
        return "fp32"
    return {"float32": "fp32", "float16": "fp16"}.get(str(name), "bf16")


def _training_checkpoint(path: str) -> Source:
    from kvlab.nn.config import ModelConfig
    from kvlab.train.loop import CHECKPOINT_FORMAT

    if not os.path.isfile(path):
        raise PlanError(f"no such checkpoint: {path}")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - torch raises many types on a bad file
        raise PlanError(f"{path} is not a readable torch checkpoint ({type(error).__name__})") from None
    if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT or not saved.get("model_config"):
        raise PlanError(f"{path} is not a kvlab training checkpoint")
    model = Decoder.from_state_dict(ModelConfig(**saved["model_config"]), saved["model"])
    return Source(model.float().eval(), None, path, None)


def convert_model(model: Decoder, kv_heads: Optional[int], method: str, seed: int) -> Decoder:
    """The KV-head conversion (kvlab.checkpoints.convert), or the model itself when none is asked."""
    if kv_heads is None:
        return model
    from kvlab.checkpoints.convert import convert_kv_heads
    return convert_kv_heads(model, kv_heads, method, seed)


def check_out(out: str, force: bool) -> None:
    """Refuse before any work: OUT must not exist (or `force`), and its parent must be writable."""
    if os.path.exists(out) and not force:
        raise PlanError(f"{out} already exists; choose another -o or pass --force to replace it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise PlanError(f"{out} exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise PlanError(f"the folder {parent} does not exist")


def write_outputs(model: Decoder, source: Source, out: str, gguf: bool, force: bool,
                  step: Callable[[str], None] = lambda _: None, dtype: Optional[torch.dtype] = None) -> list[str]:
    """Write OUT atomically, the safetensors in `dtype` (default: the model's); the files written,
    relative to OUT. model.gguf is F32 whatever the dtype."""
    from kvlab.checkpoints.hf import save_hf

    check_out(out, force)
    if gguf and source.tokenizer_metadata is None:
        raise PlanError("--gguf copies the source GGUF's tokenizer; convert from a .gguf file or a model name")
    def fill(staging) -> None:
        temporary = str(staging)
        step("safetensors")
        if dtype is not None and dtype != model.dtype:
            from copy import deepcopy
            save_hf(deepcopy(model).to(dtype), temporary, source.tokenizer)
        else:
            save_hf(model, temporary, source.tokenizer)
        _write_generation_config(temporary, source.tokenizer)
        if gguf:
            step("gguf")
            from kvlab.checkpoints.gguf_write import write_gguf
            write_gguf(model, os.path.join(temporary, GGUF_NAME), source.tokenizer_metadata)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(temporary):  # readable by other users, as the folder is
            os.chmod(os.path.join(temporary, name), 0o666 & ~umask)

    write_directory(os.path.abspath(out), fill)
    return sorted(os.listdir(out))


def _write_generation_config(directory: str, tokenizer: Optional[Tokenizer]) -> None:
    """generation_config.json and the config's token ids, which transformers' generate reads."""
    if tokenizer is None:
        return
    ids = {key: value for key, value in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id))
           if value is not None}
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    config.update(ids)
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2)
    with open(os.path.join(directory, "generation_config.json"), "w") as handle:
        json.dump({**ids, "_from_model_config": True}, handle, indent=2)
