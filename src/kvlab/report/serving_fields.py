"""The serving report's section on vLLM's request fields: lm-eval against vLLM, structured outputs, plain requests.

Read from three JSON files that scripts/serving_report.sh writes: `lm_eval.json`
(`kvlab bench lm-eval`), `structured.json` (`kvlab bench structured`) and
`compare_plain.json` (`kvlab bench compare` of this server against the one before the fields).
"""

from __future__ import annotations

from typing import Optional

from kvlab.report.markdown import table
from kvlab.report.serving_cells import provenance_text, run_of


def lm_eval_lines(r: Optional[dict]) -> list[str]:
    lines = ["## lm-evaluation-harness: kvlab serve against vLLM's server", ""]
    if r is None:
        return lines + ["Not measured yet: `PIECES=lmeval scripts/serving_report.sh`.", ""]
    from kvlab.bench.lm_eval_compare import lm_eval_command
    lines += [f"lm-eval 0.4.13's `local-completions` model against each server in turn, on two tasks built from "
              f"the ../shared novels ({r['tasks'].get('kvlab_novel_cloze', 0)} cloze items scored by log-likelihood, "
              f"four choices each: `echo`, `logprobs`, `max_tokens` 0 as lm-eval sends them; "
              f"{r['tasks'].get('kvlab_passkey', 0)} passkey prompts answered by greedy generation; "
              "kvlab.evals.lm_eval_tasks), with each server's own tokenizer through `/tokenize` "
              "(lm-eval's remote backend). `kvlab` is `kvlab serve` as a user starts it (Q4_1 weights, int16 "
              "activations), `kvlab-dense` the same GGUF dequantised to fp32 (`--weights dense`), `vllm` vLLM's "
              "CPU server on kvlab's fp32 export of that GGUF (`--dtype float32`). kvlab-dense and vLLM compute "
              "with the same weights in the same precision, so their log-likelihoods may differ only by the order "
              "of float32 sums (a few 1e-5 nats over a hundred tokens); kvlab's default also rounds activations to "
              f"int16, which moves them more. Measured at {provenance_text(r)}:", "", "```bash",
              "kvlab bench lm-eval --json reports/serving/lm_eval.json", "```", "",
              "A user's command for a server on port 8000, with the tasks written to `tasks/` "
              "(`kvlab.evals.lm_eval_tasks.write_tasks`):", "",
              "```bash", lm_eval_command("http://127.0.0.1:8000", r["model"], "tasks"), "```", "", lm_eval_table(r), ""]
    return lines


def lm_eval_table(result: dict) -> str:
    """The servers' accuracies, then each pair's largest per-item differences (what `kvlab bench lm-eval` prints)."""
    servers = [[name, f"{r['cloze_acc']:.3f}", f"{r['passkey_exact_match']:.3f}", f"{r['seconds']:.0f}"]
               for name, r in result["servers"].items()]
    pairs = [[pair, f"{c['max_abs_loglikelihood_diff']:.2e}", f"{c['mean_abs_loglikelihood_diff']:.2e}",
              c["cloze_choices_differing"], c["passkey_answers_differing"]] for pair, c in result["pairs"].items()]
    return "\n".join(table(["server", "cloze acc", "passkey exact match", "seconds"], servers, "lrrr") + [""]
                     + table(["pair", "largest per-item log-likelihood difference (nats)", "mean",
                              "cloze answers differing", "passkey answers differing"], pairs, "lrrrr"))


def structured_lines(s: Optional[dict]) -> list[str]:
    lines = ["## Structured outputs", ""]
    if s is None:
        return lines + ["Not measured yet: `PIECES=structured scripts/serving_report.sh`.", ""]
    lines += [f"`kvlab bench structured --json reports/serving/structured.json`, at {provenance_text(s)}.",
              ""]
    b = s.get("backends")
    if b:
        lines += [f"Grammar libraries on SmolLM2's {b['vocab']:,}-token vocabulary, {b['rows']} requests under one "
                  "JSON schema (compile: the tokenizer's index is built once per server and not counted; fill and "
                  f"apply: per step for {b['rows']} rows, averaged over {b['steps']} sampled steps):", "",
                  ]
        rows = []
        for name in ("llguidance", "xgrammar"):
            r = b.get(name, {})
            if "skipped" in r or not r:
                rows.append([name, r.get("skipped", "not run"), None, None])
            else:
                rows.append([name, f"{r['compile_s'] * 1e3:.1f} ms", f"{r['fill_s'] * 1e3:.2f} ms",
                             f"{r['apply_s'] * 1e3:.2f} ms"])
        lines += table(["library", "compile", "fill masks", "apply masks"], rows, "lrrr")
        lines += ["", "kvlab uses llguidance (its apply step here is kvlab's own numpy unpacking, as in the engine)."
                  + (f" This table: {provenance_text({'provenance': s['backends_provenance']})}; "
                     f"{s.get('backends_note', '')}." if "backends_provenance" in s else ""), ""]
    v = s.get("validity")
    if v:
        verdict = "met" if v["valid"] == v["answers"] else "not met"
        lines += [f"Validity: {v['valid']} of {v['answers']} answers parse and validate against their schema "
                  f"(target 100%: {verdict}); chat requests with `response_format` json_schema over five strict "
                  f"schemas, {v['concurrency']} at a time, temperature 0.7, a seed each, at most {v['max_tokens']} "
                  f"tokens; finish reasons {v['finish_reasons']}. An answer:", "", "```json", v["examples"][0], "```",
                  ""]
    c = s.get("step_cost")
    if c:
        verdict = "met" if c["ratio"] <= c["target_ratio"] else "not met"
        lines += [f"Step cost: {c['rows']} requests decoding, all free or all under a JSON schema, taking turns "
                  f"{c['repeats']} times ({c['decode_steps_per_run']} decode steps timed per run): median step "
                  f"{c['free_median_ms']:.1f} ms free, {c['constrained_median_ms']:.1f} ms constrained, "
                  f"**{c['ratio']:.3f}x** (target at most {c['target_ratio']:.2f}x: {verdict}). Per run, free "
                  f"{', '.join(f'{x:.1f}' for x in c['free_step_ms'])} ms; constrained "
                  f"{', '.join(f'{x:.1f}' for x in c['constrained_step_ms'])} ms."
                  + (" The machine's 1-minute load average was {:.1f} before and {:.1f} after: other work shared "
                     "it, so compare the ratio, not the step times.".format(*c["load_average_1m"])
                     if "load_average_1m" in c else ""), ""]
    return lines


def plain_lines(result: Optional[dict]) -> list[str]:
    lines = ["## Requests without the new fields: no slower", ""]
    if result is None:
        return lines + ["Not measured yet: `PIECES=plain scripts/serving_report.sh`.", ""]
    lines += ["`kvlab bench compare` of this `kvlab serve` (`kvlab`) against the same server at the commit before "
              "vLLM's request fields were added (`kvlab-before`, from `git archive`), the same plain requests, taking "
              f"turns; *kvlab / it* is this server's throughput over the earlier one's. Measured at "
              f"{provenance_text(result)}.", ""]
    rows = []
    before = next((p for p in result["peers"] if p["name"] != "kvlab"), None)
    kvlab = next((p for p in result["peers"] if p["name"] == "kvlab"), None)
    for cell in result["cells"]:
        a, b = run_of(kvlab, cell), run_of(before, cell)
        if a is None or b is None:
            continue
        ratio = cell["kvlab_over_peer"].get(before["name"])
        rows.append([cell["input_len"], cell["max_concurrency"], f"{a['output_throughput']:.1f}",
                     f"{b['output_throughput']:.1f}", f"{ratio:.3f}x", f"{a['mean_tpot_ms']:.1f} / {b['mean_tpot_ms']:.1f}"])
    return lines + table(["prompt", "conc.", "kvlab tok/s", "kvlab-before tok/s", "kvlab / it",
                          "TPOT mean, kvlab / before"], rows, "rrrrrr") + [""]
