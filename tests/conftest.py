"""Makes tests/needs.py importable from every test folder (`from needs import ...`)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Every step on the same threads: the governor (kvlab.nn.threads) picks by timing, and a test's
# result must not depend on how busy the machine was. tests/nn/test_threads.py tests it directly.
os.environ.setdefault("KVLAB_THREADS", "fixed")
# Products on the C kernels unless a test asks for the library: the crossover (kvlab.nn.matmul_backend)
# is timed, and a test's arithmetic must not depend on it.
os.environ.setdefault("KVLAB_MATMUL_BACKEND", "kernels")
