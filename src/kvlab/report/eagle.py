"""reports/speculative/eagle/README.md from `kvlab bench eagle`'s results.json: every figure comes from it."""

from __future__ import annotations

from kvlab.report.markdown import table
from kvlab.report.speculative import current_command


def render(result: dict) -> str:
    """The page of `kvlab bench eagle`'s results: a grid run's, or the batch-1 greedy EAGLE run's."""
    if "heads" in result:
        return render_grid(result)
    p = result["provenance"]
    machine = p.get("machine", {})
    cpu = f"{machine.get('cpu', 'this machine')} ({machine.get('torch_threads', '?')} threads)"
    lines = ["# An EAGLE head on SmolLM2-135M", "",
             "Regenerate with:", "", "```bash", f"flock /tmp/kvlab-heavy.lock {current_command(result['command'])}", "```", "",
             f"Measured at commit `{p.get('git_commit', '?')}` on {cpu}. Batch 1, greedy, {result['prompts']} held-out "
             f"ShareGPT first turns, {result['max_tokens']} new tokens each (EOS ignored), {result['rounds']} "
             "interleaved rounds; speed-up against the mean of every plain run in the same process "
             f"({result['baseline_tok_s']:.1f} tok/s; runs " +
             ", ".join(f"{v:.1f}" for v in result["baseline_runs_tok_s"]) + ").", ""]
    training = result["head_training"]
    val = (training.get("validation") or {}).get("chat", {})
    hc = result["head_config"]
    lines += [f"Head: {hc['n_heads']}x{hc['head_dim']} attention over a window of {hc['window']}, FFN {hc['ffn']}, "
              f"draft vocabulary {hc['draft_vocab']:,} of {hc['target_vocab']:,} "
              f"({(training.get('draft_vocab_coverage') or 0):.1%} of the target's training-set choices), "
              f"{(training.get('params') or 0) / 1e6:.1f}M parameters; trained {training.get('step')} steps on "
              f"{training.get('positions') or 0:,} positions in {training.get('train_seconds')} s "
              f"({training.get('status')}); held-out greedy agreement {val.get('agree1', 0):.3f} at position 1, "
              f"{val.get('agree2', 0):.3f} at position 2 (teacher-forced).", "",
              f"Costs in plain steps (plain step {result['step_costs'].get('plain_step_ms', 0):.2f} ms): one head round "
              f"{result['head_round_ms']:.2f} ms = {result['head_round_cost'] or 0:.3f}; verification of n tokens " +
              ", ".join(f"n={n}: {v:.2f}" for n, v in result["step_costs"].get("verify_cost", {}).items()) + ".", "",
              *table(["k", "tok/s", "speed-up", "acceptance per position", "mean acceptance length", "step cost",
                      "predicted L/cost", "L needed for 1.5x", "greedy identical"],
                     [[r["k"], f"{r['tok_s']:.1f}", f"**{r['speedup']:.2f}x**",
                       " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"]),
                       f"{r['mean_acceptance_length']:.2f}", f"{r['step_cost'] or 0:.2f}",
                       f"{r['predicted_speedup'] or 0:.2f}x", f"{r['length_needed_for_1_5x'] or 0:.2f}",
                       r["greedy_identical"]] for r in result["results"]])]
    best = max(result["results"], key=lambda r: r["speedup"])
    lines += ["", f"Best: k = {best['k']}, **{best['speedup']:.2f}x** (target 1.5x"
              + (": met)." if best["speedup"] >= 1.5 else f": not met; at this step cost it needs a mean acceptance "
                 f"length of {best['length_needed_for_1_5x'] or 0:.2f}, measured {best['mean_acceptance_length']:.2f}).")]
    return "\n".join(lines) + "\n"


def render_grid(result: dict) -> str:
    """The page of a grid run (--method, --batch, --temperature): every cell, and where speculation stops paying."""
    p = result["provenance"]
    machine = p.get("machine", {})
    cpu = f"{machine.get('cpu', 'this machine')} ({machine.get('torch_threads', '?')} threads)"
    costs = result["step_costs"]
    lines = ["# EAGLE and Medusa heads on SmolLM2-135M: batch, temperature, k", "",
             "Regenerate with:", "", "```bash", f"flock /tmp/kvlab-heavy.lock {current_command(result['command'])}", "```", "",
             f"Measured at commit `{p.get('git_commit', '?')}` on {cpu}. {result['prompts']} held-out ShareGPT first "
             f"turns, {result['max_tokens']} new tokens each (EOS ignored), {result['rounds']} interleaved rounds; "
             "each speed-up is against the plain runs of the same batch and temperature in the same process "
             "(tok/s: " + "; ".join(f"{c} {v:.1f}" for c, v in result["baseline_tok_s"].items()) + ").", ""]
    for m, h in result["heads"].items():
        val = ((h["training"].get("validation") or {}).get("chat") or {})
        agree = ", ".join(f"{val[f'agree{j}']:.3f}" for j in range(1, 4) if f"agree{j}" in val)
        lines.append(f"- {m}: {h['path']}, {(h['training'].get('params') or 0) / 1e6:.1f}M parameters, trained "
                     f"{h['training'].get('step')} steps on {h['training'].get('positions') or 0:,} positions in "
                     f"{h['training'].get('train_seconds')} s; held-out greedy agreement per draft position {agree}.")
    lines += ["", f"Costs in plain batch-1 steps (plain step {costs.get('plain_step_ms', 0):.2f} ms): verification "
              "of n tokens " + ", ".join(f"n={n}: {v:.2f}" for n, v in costs.get("verify_cost", {}).items())
              + "; head pass " + "; ".join(f"{m} k={k}: {ms:.2f} ms" for m, by_k in result["head_pass_ms"].items()
                                           for k, ms in by_k.items()) + ".", "",
              *table(["method", "batch", "temperature", "k", "tok/s", "speed-up", "acceptance per position",
                      "mean acceptance length", "step cost (batch 1)", "predicted L/cost",
                      "acceptance needed for 1.5x", "greedy identical"],
                     [[r["method"], r["batch"], f"{r['temperature']:g}", r["k"], f"{r['tok_s']:.1f}",
                       f"**{r['speedup']:.2f}x**", " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"]),
                       f"{r['mean_acceptance_length']:.2f}", f"{r['step_cost'] or 0:.2f}",
                       f"{r['predicted_speedup'] or 0:.2f}x",
                       "unreachable" if r["acceptance_needed_for_1_5x"] is None
                       else f"{r['acceptance_needed_for_1_5x']:.2f}",
                       "" if r["greedy_identical"] is None else r["greedy_identical"]]
                      for r in sorted(result["results"],
                                      key=lambda r: (r["method"], r["batch"], r["temperature"], r["k"]))])]
    lines += ["", "Where speculation stops paying (best k per cell):", ""]
    for m in result["heads"]:
        for b in sorted({r["batch"] for r in result["results"]}):
            row = []
            for t in sorted({r["temperature"] for r in result["results"]}):
                cell = [r for r in result["results"] if (r["method"], r["batch"], r["temperature"]) == (m, b, t)]
                if cell:
                    best = max(cell, key=lambda r: r["speedup"])
                    row.append(f"temperature {t:g}: {best['speedup']:.2f}x (k={best['k']})")
            lines.append(f"- {m}, batch {b}: " + "; ".join(row))
    return "\n".join(lines) + "\n"
