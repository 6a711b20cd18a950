"""One progress-bar style for long jobs: live on a terminal, a line a minute in a log file."""

from __future__ import annotations

import sys


def progress_bar(total: int, label: str, initial: int = 0, enabled: bool = True, unit: str = "it"):
    """A tqdm bar on stderr, or None when disabled (callers check)."""
    if not enabled:
        return None
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=label, unit=unit, file=sys.stderr, dynamic_ncols=True,
                leave=tty, mininterval=0.5 if tty else 60.0)
