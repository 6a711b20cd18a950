"""Lets tests/bench import tests/server's helpers (`from server_helpers import Served`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
