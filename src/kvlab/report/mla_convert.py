"""reports/mla-convert/README.md: perplexity against cached bytes of in-memory MLA conversions.

Renders every <model>.json that `kvlab bench mla-quality` wrote into the folder; measures nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

LEGACY_SCRIPT = "mla_quality.py "  # the script the first results were measured with, before the sub-command


def command_of(data: dict) -> str:
    """The command that measures this JSON again: the one it recorded, or for a result measured by
    the old script (same flags, its provenance names the script), the sub-command that replaced it."""
    if "command" in data:
        return data["command"]
    recorded = data["provenance"]["command"]
    if recorded.startswith(LEGACY_SCRIPT):
        return "kvlab bench mla-quality " + recorded[len(LEGACY_SCRIPT):]
    return recorded


def render(folder: Path) -> str:
    lines = ["# `kvlab convert --to mla`: perplexity against cached bytes, no uptraining", "",
             "Regenerate with `kvlab report mla-convert` after measuring "
             "(commands below, each under `flock /tmp/kvlab-heavy.lock`).", "",
             "Every row is a conversion of the same source scored on the same text through its own cache "
             "(fp32 cache; the KV bytes are what `kvlab plan` counts at fp16). `rRANK ropeD xG`: latent rank, "
             "RoPE channels each of the G source KV heads keeps. Full rank with D = head dim is exact; "
             "below that nothing was trained to recover, so these are the starting points an uptraining "
             "(`kvlab uptrain`) would begin from.", ""]
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        source = data["rows"][0]["perplexity"]
        lines += [f"## {data['model']} (head dim {data['head_dim']}, {data['kv_heads']} KV heads, "
                  f"{data['layers']} layers, hidden {data['hidden']})", "",
                  f"Text: {data['text']}, {data['windows']} window(s) of {data['context']} tokens after the first "
                  f"{data['offset']}. Command: `{command_of(data)}` "
                  f"(commit {str(data['provenance']['git_commit'])[:10]}, {data['provenance']['time_utc']}).", "",
                  "| conversion | KV B/token (fp16) | of source | SVD energy kept (worst layer) | perplexity | vs source |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in data["rows"]:
            energy = f"{row['kept_energy_min']:.4f}" if "kept_energy_min" in row else ""
            lines.append(f"| {row['label']}{' (exact)' if row.get('exact') else ''} | "
                         f"{row['kv_bytes_per_token_fp16']:,} | {row['cache_fraction']:.3f} | {energy} | "
                         f"{row['perplexity']:.3f} | {row['perplexity'] / source - 1:+.1%} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def write(folder: Path) -> Path:
    from kvlab.files import write_atomic

    return write_atomic(Path(folder) / "README.md", render(folder))
