#!/usr/bin/env bash
# Set up, then run the default (fast) test suite. Slow tests: python3 -m pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest "$@"
