"""The serving report's section on llama.cpp's own C++ server: the matrix-engine issue's targets against it.

The issue asks kvlab to serve at least 1.5x llama-server's output tokens at concurrency 1 and 2.5x at 16
and 32, and its TPOT at concurrency 1 to be within 15% of kvlab's in-process step. The sweep is one
`kvlab bench compare --peers kvlab,llama-server` run (both servers up, taking turns per cell), so each
ratio is of the same minute on the same machine.
"""

from __future__ import annotations

from typing import Optional

from kvlab.report.serving_cells import provenance_text, run_of

PEER = "llama-server"
TARGETS = {1: 1.5, 16: 2.5, 32: 2.5}  # concurrency -> kvlab's output tok/s over llama-server's


def llama_server_verdicts(result: dict) -> list[str]:
    """One line per cell with a target: kvlab's output tok/s over llama-server's, met or not, and TPOTs."""
    peers = {p["name"]: p for p in result["peers"] if p["status"] == "ran"}
    if "kvlab" not in peers or PEER not in peers:
        return []
    lines = []
    for cell in result["cells"]:
        target = TARGETS.get(cell["max_concurrency"])
        mine, theirs = run_of(peers["kvlab"], cell), run_of(peers[PEER], cell)
        if target is None or mine is None or theirs is None:
            continue
        head = f"- prompt {cell['input_len']}, concurrency {cell['max_concurrency']}: kvlab " \
               f"{mine['output_throughput']:.1f} output tok/s, {PEER} {theirs['output_throughput']:.1f}"
        if not theirs["completed"]:
            lines.append(f"{head}: {PEER} completed none of its {theirs['failed']} requests within the client's "
                         f"request timeout, so no ratio (target {target:g}x).")
            continue
        ratio = mine["output_throughput"] / theirs["output_throughput"]
        verdict = "met" if ratio >= target else "NOT met"
        short = theirs["total_output_tokens"] < 0.99 * theirs.get("requested_output_tokens", 0)  # over 1% short
        lines.append(f"{head}: **{ratio:.2f}x** (target {target:g}x: {verdict}); mean TPOT "
                     f"{mine['mean_tpot_ms']:.1f} against {theirs['mean_tpot_ms']:.1f} ms, mean TTFT "
                     f"{mine['mean_ttft_ms']:,.0f} against {theirs['mean_ttft_ms']:,.0f} ms." + (
                         f" {PEER} wrote {theirs['total_output_tokens']:,} of the "
                         f"{theirs['requested_output_tokens']:,} tokens asked"
                         + ("" if peers[PEER].get("vllm_extras") else " (it was not sent ignore_eos and stops at "
                            "end-of-sequence)") + ", kvlab all of them: not the same work." if short else ""))
    return lines


def llama_server_section(result: Optional[dict], table_lines: list[str], prompts: str, piece: str) -> list[str]:
    """The section for one prompt set (`prompts`: "128-token prompts", "ShareGPT first turns"): what ran, the
    compare table (`table_lines`, rendered by the caller), the verdicts."""
    lines = [f"## llama.cpp's own server (llama-server), {prompts}", ""]
    if result is None:
        return lines + ["Not measured yet: `scripts/build_llama_server.sh`, then "
                        f"`PIECES={piece} scripts/serving_report.sh`.", ""]
    return lines + [
        "`kvlab serve` with its defaults against llama.cpp's C++ server on the same GGUF (`llama-server -np 32`, "
        "continuous batching over 32 slots of 2,048 tokens, built by `scripts/build_llama_server.sh`: AVX2, "
        f"AVX-512 and AMX off), {result['workload']['output_len']} tokens out, the two servers taking turns per "
        "cell. Client, servers and model share the machine's 2 cores.", "", f"Measured at {provenance_text(result)}.", "", *table_lines, "",
        *llama_server_verdicts(result), ""]


GEMMA_TARGET = (16, 2.0)  # the keystone issue's: at concurrency 16, kvlab at least 2x the best peer


def gemma_section(result: Optional[dict], table_lines: list[str]) -> list[str]:
    """Gemma 3 270M (sliding and global layers in one pool) against llama-server and vLLM on the same model."""
    lines = ["## Gemma 3 270M against llama-server and vLLM", ""]
    if result is None:
        return lines + ["Not measured yet: `PIECES=gemma scripts/serving_report.sh`.", ""]
    lines += ["`kvlab serve gemma-3-270m` (its sliding and global layers in one pool, decoded by the C step) "
              "against llama-server on the same Q4_K_M GGUF and vLLM on kvlab's bf16 HF export, 128-token prompts, "
              "64 tokens out, the servers taking turns per cell. Client, servers and model share the machine's "
              "2 cores.", "", f"Measured at {provenance_text(result)}.", "", *table_lines, ""]
    level, target = GEMMA_TARGET
    for cell in result["cells"]:
        best = cell["best_peer"]
        if cell["max_concurrency"] != level or not best:
            continue
        ratio = cell["kvlab_over_peer"][best["name"]]
        lines.append(f"- prompt {cell['input_len']}, concurrency {level}: **{ratio:.2f}x** the best peer "
                     f"({best['name']}, {best['output_throughput']:.1f} output tok/s); target {target:g}x: "
                     f"{'met' if ratio >= target else 'NOT met'}.")
    return lines + [""]


def gemma_bound_lines(bound: Optional[dict], compare: Optional[dict]) -> list[str]:
    """Where Gemma 3's serving time goes (`kvlab bench serving-bound` on it: prefill per token, each decode step
    split into layers, LM head and greedy pick) and the fastest run of the workload those costs allow: the ceiling
    the 2x target is held against, as a ratio to the best peer of the compare run (two runs, so a guide)."""
    lines = ["### Where Gemma 3's time goes", ""]
    if bound is None:
        return lines + ["Not measured yet: `PIECES=boundgemma scripts/serving_report.sh`.", ""]
    from kvlab.bench.serving_bound import schedule_bounds

    requests = bound["requests"]
    per_token = bound["prefill_ms_per_token"][str(requests)]
    lines += [f"`kvlab bench serving-bound --model gemma-3-270m --weights {bound.get('weights', 'gguf')} --output-len "
              f"{bound['output_len']}`: the C step's costs, each the fastest of {bound['repetitions']} interleaved "
              f"repetitions, measured at {provenance_text(bound)}. Prefill: {per_token:.2f} ms per prompt token with "
              f"{requests} prompts of {bound['input_len']} in one call. Decode steps at position "
              f"{bound['decode_position']}, in ms:", "",
              "| rows | step | layers | LM head | greedy pick |", "|---:|---:|---:|---:|---:|"]
    for rows, step in sorted(((int(n), ms) for n, ms in bound["decode_step_ms"].items())):
        layers, pick = bound["decode_layers_ms"][str(rows)], bound["greedy_pick_ms"][str(rows)]
        lines.append(f"| {rows} | {step:.1f} | {layers:.1f} | {step - layers:.1f} | {pick:.1f} |")
    best = next((b for b in schedule_bounds(bound) if b["seats"] == requests), None)
    peer = None
    for cell in (compare or {}).get("cells", []):
        if cell["max_concurrency"] == requests and cell["best_peer"]:
            peer = cell["best_peer"]
    if best is not None:
        ceiling = f"{best['output_throughput']:.1f} output tok/s"
        if peer is not None:
            ceiling += (f", {best['output_throughput'] / peer['output_throughput']:.2f}x {peer['name']}'s "
                        f"{peer['output_throughput']:.1f} in the run above")
        lines += ["", f"With these costs and nothing else (no HTTP, sampling or detokenising, no client on the same "
                      f"cores) the workload at concurrency {requests} takes at least {best['duration_s']:.2f} s "
                      f"({best['prefill_s']:.2f} s of prefill, then {bound['output_len'] - 1} steps of "
                      f"{best['step_ms']:.1f} ms): at most {ceiling}."]
    return lines + [""]
