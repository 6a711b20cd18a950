"""Run a `kvlab` command in a child process, from a benchmark or a report's measuring step.

bench/ sits below the command line (kvlab.commands, kvlab.cli): it measures and writes JSON, and
commands are built on it. Where a measurement is a kvlab command (convert, plan, uptrain, bench
serve), it runs as a user would run it, in a child, so a refusal shows exactly as a user sees it
(exit code, one line) and no import reaches up to the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional


def kvlab_cli(argv: list[str], timeout: Optional[float] = 600, progress: bool = False) -> subprocess.CompletedProcess:
    """`python -m kvlab ARGV` with this checkout's code: stdout (and, unless `progress`, stderr) captured.

    `progress`: let the child's stderr (progress bars, log lines) through to this terminal.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                        os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "kvlab", *argv], stdout=subprocess.PIPE,
                          stderr=None if progress else subprocess.PIPE, text=True, timeout=timeout, env=env)
