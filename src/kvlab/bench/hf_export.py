"""A GGUF model as a Hugging Face directory, for the peers that serve HF directories (transformers, vLLM).

kvlab's own `save_hf` writes it (dequantised weights, config.json, tokenizer.json with the chat
template), once per model file: later calls find the directory under ~/.cache/kvlab/hf. The
directory is written beside its final name and renamed into place, so an interrupted export
never leaves a half directory that a server would load.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from kvlab.files import write_directory

CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlab" / "hf"


def hf_dir_for(model: str, dtype: str = "bfloat16", root: Optional[Path] = None) -> str:
    """The HF directory of `model` (a kvlab name or GGUF path; a directory is returned as is)."""
    import torch

    from kvlab.checkpoints.hf import save_hf
    from kvlab.checkpoints.resolve import load_model, resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return path
    stat = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}".encode()).hexdigest()[:10]
    target = Path(root or CACHE_ROOT) / f"{Path(path).stem}-{dtype}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    loaded = load_model(path, getattr(torch, dtype), "dense")
    write_directory(target, lambda staging: save_hf(loaded.model, str(staging), loaded.tokenizer))
    return str(target)
