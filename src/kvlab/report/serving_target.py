"""The serving report's verdicts on the issue's target: at concurrency 16, kvlab's output at least 5x the best
peer's with p99 TTFT and TPOT no worse than any peer's. Per compare run (`target_lines`), across the seats sweep's
settings (`seats_lines`), and against the ceiling of kvlab's own C step here (`bound_lines`,
kvlab.bench.serving_bound's costs).
"""

from __future__ import annotations

from typing import Optional

from kvlab.bench.serving_bound import best_within, prefill_needed_ms, schedule_bounds
from kvlab.report.markdown import table
from kvlab.report.serving_cells import delivered, provenance_text, run_of

TARGET_LEVEL, TARGET_RATIO = 16, 5.0


def target_lines(result: dict) -> list[str]:
    """The issue's target at concurrency 16: kvlab >= 5x the best peer, p99 TTFT and TPOT no worse than any."""
    lines = []
    kvlab = next((p for p in result["peers"] if p["name"] == "kvlab" and p["status"] == "ran"), None)
    for cell in result["cells"]:
        if cell["max_concurrency"] != TARGET_LEVEL or kvlab is None or not cell["best_peer"]:
            continue
        best = cell["best_peer"]
        ratio = cell["kvlab_over_peer"].get(best["name"])
        mine = run_of(kvlab, cell)
        others = [(run_of(p, cell), p["name"]) for p in result["peers"] if p["name"] != "kvlab"]
        others = [(r, n) for r, n in others if r is not None and r["completed"]]
        cut_off = [(r, n) for r, n in others if not delivered(r)]
        others = [(r, n) for r, n in others if delivered(r)]
        worse = [f"{n} ({metric} {r[f'p99_{metric}_ms']:.0f} ms)" for r, n in others for metric in ("ttft", "tpot")
                 if r.get(f"p99_{metric}_ms") is not None and mine.get(f"p99_{metric}_ms") is not None
                 and mine[f"p99_{metric}_ms"] > r[f"p99_{metric}_ms"]]
        verdict = "met" if ratio is not None and ratio >= TARGET_RATIO else "NOT met"
        lines.append(f"- prompt {cell['input_len']}, concurrency {TARGET_LEVEL}: kvlab {mine['output_throughput']:.1f} "
                     f"output tok/s, **{ratio:.2f}x** the best peer ({best['name']}, "
                     f"{best['output_throughput']:.1f} tok/s): the {TARGET_RATIO:g}x target is {verdict}. kvlab's p99 "
                     f"TTFT {mine['p99_ttft_ms']:.0f} ms, p99 TPOT {mine['p99_tpot_ms']:.1f} ms: "
                     + ("no worse than any peer's" if not worse else "worse than " + ", ".join(worse))
                     + ("" if not cut_off else " (latencies not compared for " + ", ".join(
                         f"{n}, which sent back {r['total_output_tokens']} of {r['requested_output_tokens']} tokens"
                         for r, n in cut_off) + ")") + ".")
    return lines


def seats_lines(result: Optional[dict]) -> list[str]:
    """Each kvlab setting of the seats sweep against the best other server: is it 5x, and are its p99 TTFT and
    TPOT no worse? Throughput asks for many rows per step, a serial server's TPOT for few: this shows where
    the two halves of the target meet, if they do."""
    if result is None:
        return []
    lines = []
    for cell in result["cells"]:
        mine = [(p["name"], run_of(p, cell)) for p in result["peers"] if p["name"].startswith("kvlab")]
        others = [(p["name"], run_of(p, cell)) for p in result["peers"] if not p["name"].startswith("kvlab")]
        others = [(n, r) for n, r in others if r is not None and r["completed"] and delivered(r)]
        if not others:
            continue
        name, peer = max(others, key=lambda item: item[1]["output_throughput"])
        both = []
        for label, run in mine:
            if run is None or not run["completed"]:
                continue
            ratio = run["output_throughput"] / peer["output_throughput"] if peer["output_throughput"] else None
            fast = ratio is not None and ratio >= TARGET_RATIO
            tpot_ok, ttft_ok = (run[f"p99_{m}_ms"] <= peer[f"p99_{m}_ms"] for m in ("tpot", "ttft"))
            if fast and tpot_ok and ttft_ok:
                both.append(label)
            lines.append(f"- {label}: {run['output_throughput']:.1f} tok/s, {ratio:.2f}x {name} "
                         f"({'at least' if fast else 'under'} {TARGET_RATIO:g}x); p99 TPOT {run['p99_tpot_ms']:.1f} ms "
                         f"against {peer['p99_tpot_ms']:.1f} ({'no worse' if tpot_ok else 'worse'}), p99 TTFT "
                         f"{run['p99_ttft_ms']:.0f} ms against {peer['p99_ttft_ms']:.0f} "
                         f"({'no worse' if ttft_ok else 'worse'}).")
        lines += ["", f"Prompt {cell['input_len']}, concurrency {cell['max_concurrency']}: "
                  + (f"{', '.join(both)} {'meets' if len(both) == 1 else 'meet'} both halves of the target."
                     if both else "no setting meets both halves of the target in this run."), ""]
    return lines


def _seats_served(peer: dict, cell: dict) -> int:
    """Rows a kvlab server decoded at once in a cell: its --max-num-seqs, or (the default, 64, exceeding every
    concurrency measured) the cell's concurrency."""
    argv = peer.get("argv") or []
    seats = int(argv[argv.index("--max-num-seqs") + 1]) if "--max-num-seqs" in argv else None
    return min(seats or cell["max_concurrency"], cell["max_concurrency"])


def bound_lines(costs: Optional[dict], seats: Optional[dict]) -> list[str]:
    """The target against what kvlab's C step can do here at all (kvlab.bench.serving_bound's costs), held against
    the seats sweep's best other server and set beside what kvlab served there."""
    lines = ["## What the target needs on this machine", ""]
    if costs is None:
        return lines + ["Not measured yet: `PIECES=bound scripts/serving_report.sh`.", ""]
    cell = seats["cells"][0] if seats else None
    others = [(p["name"], run_of(p, cell)) for p in seats["peers"] if not p["name"].startswith("kvlab")] if cell else []
    others = [(n, r) for n, r in others if r is not None and r["completed"] and delivered(r)]
    if not others or cell["max_concurrency"] != costs["requests"]:
        return lines + ["The seats sweep (`PIECES=seats`) at the same concurrency is needed to hold these costs "
                        "against a peer.", ""]
    name, peer = max(others, key=lambda item: item[1]["output_throughput"])
    limit, goal = peer["p99_tpot_ms"], TARGET_RATIO * peer["output_throughput"]
    bounds = schedule_bounds(costs, limit)
    served: dict[int, tuple[str, dict]] = {}  # seats -> the fastest kvlab server of the sweep that decoded that many
    for p in seats["peers"]:
        run = run_of(p, cell)
        if p["name"].startswith("kvlab") and run is not None and run["completed"]:
            seats_of = _seats_served(p, cell)
            if seats_of not in served or run["output_throughput"] > served[seats_of][1]["output_throughput"]:
                served[seats_of] = (p["name"], run)
    per_token = costs["prefill_ms_per_token"]
    lines += [f"`kvlab bench serving-bound --weights {costs.get('weights', 'gguf-a8')}` times kvlab's C "
              f"step on the engine's own pool for the target's workload ({costs['requests']} prompts of "
              f"{costs['input_len']} tokens, {costs['output_len']} out), measured at {provenance_text(costs)}: prefill "
              f"{per_token[str(costs['requests'])]:.3f} ms per prompt token with all {costs['requests']} prompts in "
              f"one call ({per_token['1']:.3f} with one), and the decode steps below. Each cost is the fastest of "
              f"{costs['repetitions']} interleaved repetitions, the figure most favourable to the target (this "
              f"shared machine's speed drifts from minute to minute by more than the gaps below).",
              "",
              f"With prompts prefilled in one call and sequences decoding in groups of s (`--max-num-seqs s`), every "
              f"request's TPOT is the step at s rows, and no run can be shorter than the prefill plus "
              f"ceil({costs['requests']} / s) x {costs['output_len'] - 1} steps. The columns *run at least* and *at "
              f"most* are that ceiling, before anything the server adds per step (HTTP, sampling, detokenising). The "
              f"served columns are the seats sweep's above (its fastest server at each seat count), and the peer is "
              f"its {name}: {peer['output_throughput']:.1f} output tok/s at a p99 TPOT of {limit:.1f} ms, so the "
              f"target asks for {goal:.1f} tok/s with steps within {limit:.1f} ms.",
              ""]
    rows = []
    for b in bounds:
        label, run = served.get(b["seats"], ("-", None))
        served_cells = [label, f"{run['p99_tpot_ms']:.1f}", f"{run['output_throughput']:.1f}"] if run else ["-"] * 3
        rows.append([b["seats"], f"{b['step_ms']:.1f}", *served_cells, f"{b['duration_s']:.2f}",
                     f"{b['output_throughput']:.1f}", f"{b['output_throughput'] / peer['output_throughput']:.2f}x",
                     "yes" if b["within_tpot"] else "no"])
    lines += table(["seats", "C step ms", "served by", "served p99 TPOT", "served tok/s", "run at least s",
                    "at most tok/s", "x the peer", "step within its p99 TPOT"], rows, "rrlrrrrrl")
    fastest = max(bounds, key=lambda b: b["output_throughput"])
    lines += ["", _needs("Throughput alone", fastest, costs, goal, per_token)]
    best = best_within(bounds)
    lines.append(_needs("Both halves", best, costs, goal, per_token, limit) if best else
                 f"- Both halves: no step here is within {limit:.1f} ms, not even one row's.")
    return lines + [""]


def _needs(what: str, bound: dict, costs: dict, goal: float, per_token: dict, limit: Optional[float] = None) -> str:
    """One line: the ceiling of `bound`'s schedule against the target, and the prefill speed the target would need."""
    measured = per_token[str(costs["requests"])]
    needed = prefill_needed_ms(costs, bound, goal)
    within = f" (the fastest run of those whose step is within {limit:.1f} ms)" if limit else ""
    head = (f"- {what}: {bound['seats']} seats{within}, at most {bound['output_throughput']:.1f} tok/s, "
            f"{'at least' if bound['output_throughput'] >= goal else 'under'} the {goal:.1f} asked")
    if bound["output_throughput"] >= goal:
        return head + "."
    if needed is None:
        return head + "; its decode steps alone take longer than the whole run may."
    return head + (f"; it would need prefill at {needed:.3f} ms per prompt token, {measured / needed:.2f}x the "
                   f"speed measured.")
