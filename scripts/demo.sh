#!/usr/bin/env bash
# Set up, then run kvlab's main job on an embedded default: plan Llama-3-8B on an H100.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
kvlab plan llama-3-8b --gpu h100-sxm --context 8192 --batch 8
kvlab plan llama-3-8b --gpu h100-sxm --context 8192 --batch 8 --compare mha,gqa:8,mqa,mla --compare-dtypes fp16,fp8
