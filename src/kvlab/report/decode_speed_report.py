"""reports/decode_speed/README.md, written from the benchmark's JSON files and nothing else.

    kvlab report decode-speed [reports/decode_speed]

Every figure in the page (rates, ratios, prompt length, prefill time, commit, dirty files) is
read from smollm2_threads2.json and smollm2_threads1.json as kvlab.bench.decode_speed wrote
them, so the words cannot drift from the measurements. Hand-written history lives in
notes.md beside them and is appended as it is.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvlab.files import write_atomic
from kvlab.report.markdown import table

RUNS = (("2 threads", "smollm2_threads2.json"), ("1 thread", "smollm2_threads1.json"))


def _engine(result: dict, prefix: str) -> dict:
    return next(run for run in result["runs"] if run["engine"].startswith(prefix))


# What each kvlab packing quantises activations to (older results record no packing: "gguf").
ACTIVATIONS = {"gguf": "int16 activations", "gguf-a8": "int8 activations on the Q4_1 blocks, int16 on the Q8_0 ones"}


def _commit(result: dict) -> str:
    prov = result["provenance"]
    commit = (prov.get("git_commit") or "unknown")[:7]
    dirty = prov.get("git_dirty_files")
    if dirty:
        return f"{commit} with {', '.join(dirty)} edited"
    if (prov.get("git_commit") or "").endswith("+dirty"):
        return f"{commit} with tracked files edited (which, this older result did not record)"
    return commit


def render(folder: Path) -> str:
    results = {label: json.loads((folder / name).read_text()) for label, name in RUNS}
    first = next(iter(results.values()))
    rows = [("kvlab, fused decode step", "kvlab (gguf weights, fused"), ("kvlab, module by module", "kvlab (gguf weights, module"),
            ("transformers generate, fp32", "transformers generate (float32"),
            ("transformers generate, bf16", "transformers generate (bfloat16")]
    lines = [
        "# Batch-1 greedy decode: kvlab against transformers (SmolLM2-135M-Instruct, Q4_1 GGUF)", "",
        "<!-- Written by `kvlab report decode-speed` from the JSON files here; edit notes.md. -->", "",
        "Regenerate (each about 100 s here), then rewrite this page:", "", "```bash",
        *[f"kvlab bench decode smollm2-135m --batch-1-race --threads {label.split()[0]} "
          f"--json reports/decode_speed/{name}" for label, name in RUNS],
        "kvlab report decode-speed reports/decode_speed", "```", "",
        f"Same GGUF file for every engine (transformers via `gguf_file=`), the same {first['prompt_tokens']}-token "
        f"prompt, exactly {first['new_tokens']} new tokens, prefill included in the time, "
        f"{first['statistic']} ({first['repeats']} timed runs after a warm-up), the engines taking turns. kvlab "
        f"computes on the file's Q4_1/Q8_0 blocks (kvlab.nn.ggml, {ACTIVATIONS[first.get('weights', 'gguf')]}) "
        "and runs twice: with each decode "
        "step fused into one C call (kvlab.nn.c_model, what `generate` does by default) and module by module. "
        "transformers dequantises to fp32 or bf16.", "",
    ]
    for label, result in results.items():
        prov = result["provenance"]
        lines.append(f"- {label}: commit {_commit(result)}, {prov['time_utc']}, {prov['machine']['cpu']} "
                     f"({prov['machine']['cores']} cores), torch {prov['torch_version']}, transformers "
                     f"{prov.get('transformers_version', '-')}.")
    lines += ["", "A shared VM's speed drifts during a day, so compare ratios within one run, not figures across "
              "runs.", ""]
    cells = [[title, *(f"{_engine(r, prefix)['tokens_per_s']:.1f}" for r in results.values())] for title, prefix in rows]
    cells.append(["**kvlab / faster transformers**",
                  *(f"**{r['ratio_vs_best_transformers']:.2f}x**" for r in results.values())])
    cells.append(["kvlab / transformers fp32", *(f"{r['ratio_vs_transformers_fp32']:.2f}x" for r in results.values())])
    lines += table(["engine", *(f"{label}, tok/s" for label in results)], cells)
    matching = [r["greedy_prefix_matching_transformers_fp32"] for r in results.values()]
    agree = ("All" if all(m == first["new_tokens"] for m in matching) else "Not all") + \
        f" {first['new_tokens']} greedy tokens equal transformers fp32's ({', '.join(map(str, matching))} in the " \
        "runs above; `greedy_prefix_matching_transformers_fp32` in the JSON)."
    lines += ["", agree + " The seconds of every timed run, the kvlab runs' prefill / decode split and the "
              "provenance are in the JSON files.", ""]
    parts = []
    for label, result in results.items():
        fused, module = _engine(result, rows[0][1]), _engine(result, rows[1][1])
        parts.append(f"with {label} the {result['prompt_tokens']}-token prompt takes "
                     f"{1000 * statistics.median(fused['prefill_seconds']):.0f} ms (median) and decoding alone runs "
                     f"at {fused['decode_only_tokens_per_s']:.1f} tok/s fused against "
                     f"{module['decode_only_tokens_per_s']:.1f} module by module")
    lines += ["Where kvlab's time goes: " + "; ".join(parts) + ". The prompt's matrices are dequantised in C and "
              "multiplied by PyTorch's GEMM; the fused step removes the Python, allocation and thread start-up cost "
              "around the 121 block products of each decode step, which on this small model outweighed the products.",
              ""]
    notes = folder / "notes.md"
    if notes.is_file():
        lines += [line for line in notes.read_text().splitlines() if not line.startswith("<!--")]
    return "\n".join(lines).rstrip() + "\n"


def write(folder: Path) -> Path:
    """README.md in `folder`, rendered from the JSON there and written atomically."""
    return write_atomic(folder / "README.md", render(folder))
