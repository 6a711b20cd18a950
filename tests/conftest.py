"""Makes tests/needs.py importable from every test folder (`from needs import ...`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
