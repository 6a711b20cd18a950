"""reports/real-models/conversions.md from `kvlab bench vllm-conversions`' JSON alone."""

from __future__ import annotations

import json

from kvlab.report.markdown import table


def render(result: dict) -> str:
    """The report's Markdown, from the JSON alone."""
    prov = result.get("provenance", {})
    lines = ["# SmolLM2-135M conversions in real vLLM", "",
             "Regenerate (≈15 min, starts vLLM once per variant): `flock /tmp/kvlab-heavy.lock kvlab bench "
             "vllm-conversions --json reports/real-models/conversions.json` (writes this file too; "
             "`kvlab report vllm-conversions JSON` re-renders it alone).", "",
             f"vLLM CPU backend, VLLM_CPU_KVCACHE_SPACE={result['kv_cache_space_gib']} GiB, `--dtype bfloat16`, "
             f"greedy, max_tokens {result['max_tokens']}, prompts sent as kvlab's token ids. "
             f"kvlab commit {prov.get('git_commit', '?')}.", "",
             ]
    rows = []
    for row in result["variants"]:
        v, p = row["vllm"], row["plan"]
        logged = f"`{v['capacity_line']}`" if v.get("started") else "vLLM did not start"
        ratio = f"{row['tokens_over_original']:.3f}x" if "tokens_over_original" in row else "-"
        rows.append([row["variant"], f"{p['kv_heads']} of {p['q_heads']}", logged, f"`{p['log_lines'][1]}`",
                     "yes" if row.get("capacity_matches_plan") else "no", ratio])
    lines += table(["variant", "KV heads", "vLLM logged", "kvlab plan predicts", "equal", "tokens vs original"], rows)
    lines += ["", f"Planner command: `{result['variants'][0]['plan']['command']}`." if result["variants"] else "", ""]
    lines += ["## Greedy text", ""]
    rows = []
    for row in result["variants"]:
        if not row["vllm"].get("started"):
            continue
        for kind, prompt in result["prompts"].items():
            theirs = row["vllm"]["texts"][kind]["text"]
            cells = [row["variant"], f"{kind}: {prompt}", _cell(theirs)]
            for dtype in ("float32", "bfloat16"):
                cells += [_cell(row["kvlab"][dtype][kind]["text"]),
                          "yes" if row["text_matches"][dtype][kind] else "**no**"]
            rows.append(cells)
    lines += table(["variant", "prompt", "vLLM (bf16)", "kvlab fp32", "=", "kvlab bf16", "="], rows)
    odd = [f"{r['variant']} {kind}" for r in result["variants"] if r["vllm"].get("started")
           for kind in result["prompts"] if not r["text_matches"]["float32"][kind] and not r["text_matches"]["bfloat16"][kind]
           and r["kvlab"]["float32"][kind]["ids"] == r["kvlab"]["bfloat16"][kind]["ids"]]
    if odd:
        lines += ["", f"Not explained by precision alone: on {', '.join(odd)} kvlab's bf16 and fp32 runs agree token "
                  "for token while vLLM's text differs from both (same prompt ids; the cause is not investigated "
                  "here)."]
    failed = [r for r in result["variants"] if not r["vllm"].get("started")]
    if failed:
        lines += ["", "## vLLM failed to start", ""]
        for row in failed:
            lines += [f"- {row['variant']} (after {row['vllm']['after_s']} s): `{_cell(row['vllm']['error'])}`"]
    for row in result.get("skipped", []):
        lines += ["", f"Not run: {row['variant']} ({row['skipped']})."]
    mla = result.get("mla")
    if mla:
        lines += ["", "## MLA (`kvlab convert --to mla`): not served", ""]
        if mla.get("convert_rc"):
            lines.append(f"`kvlab convert --to mla` itself failed: `{mla['convert_error']}`")
        else:
            lines.append(f"`{mla['command']}` exits {mla['export_rc']}: `{_cell(mla['export_message'])}`")
            lines += ["", "vLLM was not started for it: no vLLM model implements kvlab's two MLA extensions "
                      "(`kvlab_rope_key_heads`: RoPE keys per KV head rather than DeepSeek-V2's one shared rope key; "
                      "`kvlab_latent_norm: false`: no RMSNorm on the latent), so its DeepSeek-V2 loader would "
                      "compute a different model."]
    vers = {r["vllm"].get("version") for r in result["variants"] if r["vllm"].get("version")}
    lines += ["", f"vLLM {', '.join(sorted(vers)) or '?'}; machine: {prov.get('machine', {}).get('cpu', '?')}.", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1].replace("|", "\\|")
