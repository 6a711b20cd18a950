"""reports/conversions/README.md from results.json alone: the GQA paper's table (quality against cache against
speed), the serving checks, the uptraining curves' end points, and what is not measured yet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from kvlab.files import write_atomic
from kvlab.report.markdown import table


def _ppl(quality: Optional[dict], base: Optional[dict]) -> str:
    if not quality:
        return "–"
    text = f"{quality['perplexity']:,.2f}"
    if base and quality is not base:
        text += f" ({quality['perplexity'] / base['perplexity'] - 1:+.1%})"
    return text


def _keys(quality: Optional[dict]) -> str:
    return f"{quality['passkey'][0]}/{quality['passkey'][1]}" if quality else "–"


def _speed(cell: Optional[dict], grid: Optional[dict]) -> str:
    if grid is None:
        return "–"
    if not grid.get("served"):
        return "not served"
    if cell is None:
        return "–"
    if "skipped" in cell:
        return "skipped"
    if not cell.get("completed"):
        return "failed"
    return f"{cell['median_ttft_ms']:,.0f} / {cell['median_itl_ms']:,.0f} / {cell['output_throughput']:,.1f}"


def render(data: dict, variants, keys: list[str]) -> str:
    steps = data["steps"]
    base = (steps.get("quality:original:converted") or {})
    lines = ["# SmolLM2-135M converted: MQA and MLA, aligned, before and after uptraining", "",
             "<!-- Written by `kvlab report conversions` from results.json; do not edit by hand. -->", "",
             "Regenerate (resumable: repeat until it prints `complete`):", "", "```bash",
             "flock /tmp/kvlab-heavy.lock kvlab bench conversions --max-seconds 1080", "```", "",
             "Machine: AMD EPYC (Zen 2, AVX2 only, no AVX-512/AMX), 2 cores shared with other engineers' jobs "
             "(each step's 1-minute load average is in results.json beside its provenance): quality figures do not "
             "depend on it, times do.", "",
             f"Steps done: {sum(k in steps for k in keys)} of {len(keys)}."
             + (" Missing: " + ", ".join(f"`{k}`" for k in keys if k not in steps) + "." if any(
                 k not in steps for k in keys) else ""), "",
             "## Quality against cache", "",
             "Perplexity on *Frankenstein* (2 windows of 2,048 tokens from token 1,000, fp16 cache, 256 tokens at a "
             "time), change against the original; passkey retrieval at 2,048 tokens (24 keys: depths 0.1, 0.5, 0.9, "
             "4 keys each, seeds 0 and 1; the comparison rows, measured before training only, 12 keys of seed 0). Calibration and uptraining text: *Pride and Prejudice*, never the "
             "evaluation text. KV bytes per token: fp16, from kvlab plan of the written directory.", "",
             ]
    rows = []
    reports = [(steps.get(f"convert:{v.name}") or {}).get("report") or {} for v in variants]
    original_bytes = next((r["kv_bytes_per_token_fp16_before"] for r in reports if r), None)
    for v, report in zip(variants, reports):
        conv = steps.get(f"convert:{v.name}", {})
        bytes_ = report.get("kv_bytes_per_token_fp16_after") if v.convert else original_bytes
        ratio = f"{bytes_ / original_bytes:.0%}" if bytes_ and original_bytes else "–"
        before, after = steps.get(f"quality:{v.name}:converted"), steps.get(f"quality:{v.name}:uptrained")
        up = (steps.get(f"uptrain:{v.name}") or {}).get("report")
        training = ""
        if v.convert and v.uptrain:
            training = f"{up['tokens']:,} tokens, {up['train_seconds'] / 60:.0f} min" if up else "–"
        trained = v.convert and v.uptrain
        rows.append([v.label, f"`{conv.get('command', 'kvlab convert ' + v.name) if v.convert else '–'}`",
                     bytes_ if bytes_ else "–", ratio, _ppl(before, base), _keys(before),
                     _ppl(after, base) if trained else "", _keys(after) if trained else "", training])
    lines += table(["model", "conversion", "KV B/token (fp16)", "vs original", "perplexity", "passkey 2k",
                    "after uptraining", "passkey 2k", "uptraining"], rows)
    lines += ["", "## Capacity: what each server logs, against kvlab plan", "",
              "1 GiB of KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE; kvlab's engine --kv-cache-memory), bf16. MLA "
              "directories are served padded to vLLM's CPU kernel's 512 + 64 latent row (`kvlab convert DIR "
              "--pad-latent 512 --pad-rope 64`: the same function, a wider cache row), so their served capacity is that row's.", "",
              ]
    rows = []
    for v in (v for v in variants if v.served):
        for stage in (("converted", "uptrained") if v.convert and v.uptrain else ("converted",)):
            row = steps.get(f"serving:{v.name}:{stage}")
            if row is None:
                rows.append([v.label, stage, "–", "–", "–", "–", "–"])
                continue
            vllm = row.get("vllm", {})
            logged = (f"`{vllm['capacity_line']}`" if vllm.get("started")
                      else f"did not start: {vllm.get('error', '')[:80]}")
            engine = row.get("kvlab_engine", {})
            engine_cell = f"`{engine['lines'][-1]}`" if engine.get("served") else f"not served: {engine.get('why', '')}"
            text = row.get("text_matches")
            rows.append([v.label, stage, f"`{row['plan']['log_lines'][1]}`", logged,
                         "yes" if row.get("capacity_matches_plan") else "no", engine_cell,
                         ", ".join(f"{k}: {_yes(m)}" for k, m in text.items()) if text else "–"])
    lines += table(["model", "stage", "kvlab plan", "real vLLM logged", "= plan", "kvlab serve (engine)",
                    "vLLM greedy = kvlab"], rows)
    lines += ["", "## Speed: `vllm bench serve` against each server", "",
              "Median TTFT ms / median ITL ms / output tok/s; random prompts of 128 or 1,024 tokens, 64 tokens out, "
              "2 x concurrency requests (at least 4); a cell predicted to run past 10 minutes (its prompt length's "
              "last cell's time, scaled by its requests) is skipped, and the larger ones after it. vLLM runs bf16; "
              "`kvlab serve` runs `--weights q8_0` (the C step; a directory otherwise decodes module by module). "
              "Uptrained directories (speed does not depend on the weights' "
              "values). One run per cell on a shared 2-core machine: read ratios within a row, not absolutes.", ""]
    rows = []
    for server in ("vllm", "kvlab"):
        for v in (v for v in variants if v.served):
            for kv in ("auto", "fp8"):
                grid = steps.get(f"speed:{server}:{v.name}:{kv}")
                if grid is not None and not grid.get("served"):
                    rows.append([server, v.label, kv, f"not served: {grid['why']}", *[None] * 7])
                    continue
                cells = (grid or {}).get("cells", {})
                rows.append([server, v.label, kv,
                             *(_speed(cells.get(f"in{n}-c{c}"), grid) for n in (128, 1024) for c in (1, 4, 16, 32))])
    lines += table(["server", "model", "KV cache", *(f"in {n} c={c}" for n in (128, 1024) for c in (1, 4, 16, 32))],
                   rows)
    lines += ["", "## Uptraining record", ""]
    for v in variants:
        up = (steps.get(f"uptrain:{v.name}") or {}).get("report")
        if not up:
            continue
        split = ", ".join(f"{k} {x:.0%}" for k, x in up["time_split"].items())
        record = up["record"]
        lines.append(f"- {v.label}: `{steps[f'uptrain:{v.name}']['command']}`: {up['tokens']:,} tokens in "
                     f"{up['train_seconds'] / 60:.1f} min ({up['tokens_per_s']:.0f} tok/s; {split}); held-out KL to "
                     f"the teacher " + " -> ".join(f"{r['val_kl']:.3f}" for r in record[:: max(1, len(record) // 6)])
                     + f" (every {record[0]['tokens']:,}-token step of the record)")
    return "\n".join(lines) + "\n"


def _yes(flag) -> str:
    """yes / **no**, or what went wrong instead of an answer (vLLM's HTTP error, recorded by the bench)."""
    if isinstance(flag, str):
        return f"**{flag}**"
    return "yes" if flag else "**no**"


def write(out: Path) -> Path:
    """README.md in `out` from its results.json, in the steps' order (kvlab.bench.conversions)."""
    from kvlab.bench.conversions import VARIANTS, steps

    path = out / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {"report": "conversions", "steps": {}}
    return write_atomic(out / "README.md", render(data, VARIANTS, [key for key, _ in steps()]))
