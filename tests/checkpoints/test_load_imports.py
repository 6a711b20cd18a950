"""Start-up imports only what it uses: resolving a name needs neither torch nor numpy, and
loading SmolLM2 for the engine needs neither gguf-py nor transformers (each a few tenths of a
second of a cold start). Each check runs in a fresh interpreter, where sys.modules is honest.
"""

import subprocess
import sys

from needs import require_smollm2


def imported(code: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh interpreter holds after running `code`."""
    probe = code + f"\nimport sys\nprint(','.join(n for n in {names!r} if n in sys.modules))\n"
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    last = (completed.stdout.splitlines() or [""])[-1]  # an empty line when none is held
    return [name for name in last.split(",") if name]


def test_resolving_names_imports_neither_torch_nor_numpy():
    code = ("from kvlab.checkpoints.resolve import resolve_model_path\n"
            "from kvlab.plan.errors import PlanError\n"
            "for name in ('smollm2-135m', 'stories260k', 'gemma-3-270m'):\n"
            "    try:\n"
            "        resolve_model_path(name)\n"
            "    except PlanError:\n"
            "        pass  # a wheel or the shared folder is missing here: the import is what is checked\n")
    assert imported(code, ("torch", "numpy", "transformers", "gguf")) == []


def test_loading_smollm2_for_the_engine_needs_neither_gguf_py_nor_transformers():
    require_smollm2()
    code = ("from kvlab.engine.llm import load_for_engine\n"
            "model, tokenizer = load_for_engine('smollm2-135m')\n"
            "assert tokenizer.encode('Hello')\n")
    assert imported(code, ("gguf", "transformers")) == []
