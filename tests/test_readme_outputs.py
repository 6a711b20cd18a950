"""Every command output README.md shows is what the current code prints (timings aside).

scripts/readme_outputs.py regenerates them; this runs its --check, so a pasted output that
the code no longer produces fails here instead of misleading a reader.
"""

import subprocess
import sys
from pathlib import Path

from needs import require_smollm2

ROOT = Path(__file__).resolve().parents[1]


def test_readme_outputs_are_current():
    require_smollm2()  # the README runs SmolLM2 and stories260K
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_outputs.py"), "--check", "--skip-slow"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_masking_hides_timings_but_not_figures():
    sys.path.insert(0, str(ROOT / "scripts"))
    from readme_outputs import masked

    shown = "[kvlab] 5 prompt + 40 new tokens; prefill 3 ms, 555.5 tok/s decode; KV cache auto 57,600 B"
    assert masked(shown) == masked(shown.replace("3 ms", "17 ms").replace("555.5", "98.0"))
    assert masked(shown) != masked(shown.replace("57,600", "57,601"))
    assert masked(shown) != masked(shown.replace("40 new", "41 new"))
    row = "│ decode tokens/s   │   292.5 │   129.8 │"
    assert masked(row) == masked(row.replace("129.8", "1,129.8"))
