"""reports/serving/README.md, written from the JSON files beside it and nothing else.

    kvlab report serving [reports/serving]

scripts/serving_report.sh measures every piece (each under the heavy lock) and then calls
this; a piece whose JSON is missing is named as not measured. Every figure and ratio below
is read from the JSON that `kvlab bench compare`, `kvlab bench decode`,
`kvlab bench prefix-ttft` and `kvlab bench reliability` wrote, so the words cannot drift
from the measurements.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from kvlab.bench.vllm_interop import COMPARED
from kvlab.files import write_atomic
from kvlab.report.markdown import table
from kvlab.report.serving_cells import provenance_text, run_of
from kvlab.report.serving_fields import lm_eval_lines, plain_lines, structured_lines
from kvlab.report.serving_llama_server import gemma_bound_lines, gemma_section, llama_server_section
from kvlab.report.serving_target import bound_lines, seats_lines, target_lines


def _load(folder: Path, name: str) -> Optional[dict]:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _partial(result: dict) -> str:
    return " The run was interrupted: only the cells below were measured." if result.get("interrupted") else ""


def compare_table(result: dict) -> list[str]:
    """A row per (prompt, concurrency, server): the figures and kvlab's same-run ratio to it."""
    rows = []
    for cell in result["cells"]:
        for peer in result["peers"]:
            run = run_of(peer, cell)
            if run is None:
                continue
            ratio = cell["kvlab_over_peer"].get(peer["name"])
            name = f"**{peer['name']}**" if peer["name"] == "kvlab" else peer["name"]
            rows.append([cell["input_len"], cell["max_concurrency"], name, f"{run['completed']} / {run['failed']}",
                         f"{run['total_output_tokens']} / {run['requested_output_tokens']}",
                         f"{run['output_throughput']:.1f}", "-" if ratio is None else f"{ratio:.2f}x",
                         *(_ms(run.get(k)) for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                                                     "mean_itl_ms")),
                         run.get("load_average_1m_before", "-")])
    return table(["prompt", "conc.", "server", "ok / failed", "tokens back / asked", "output tok/s", "kvlab / it",
                  "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99", "ITL mean", "load before"], rows, "rrl" + "r" * 10)


def peers_notes(result: dict) -> list[str]:
    lines = []
    for peer in result["peers"]:
        if peer["status"] != "ran":
            lines.append(f"- {peer['name']}: {peer['status']}: {peer['reason']}")
        else:
            lines.append(f"- {peer['name']}: {peer['note']}; up in {peer['startup_s']:.0f} s; vLLM's extra fields "
                         f"(ignore_eos, stream_options) {'sent' if peer['vllm_extras'] else 'not sent'}.")
    return lines


def failure_notes(result: dict) -> list[str]:
    """Where requests failed, how many and the first error the client saw (a timeout, a 500): never left out."""
    lines = []
    for peer in result["peers"]:
        for run in peer.get("runs", []):
            if run.get("failed"):
                errors = run.get("first_errors") or ["no error recorded"]
                lines.append(f"- {peer['name']} at prompt {run['input_len']}, concurrency {run['max_concurrency']}: "
                             f"{run['failed']} of {run['completed'] + run['failed']} requests failed; the first: "
                             f"\"{errors[0]}\".")
    return lines


def variant_section(result: Optional[dict], title: str, what: str, name: str) -> list[str]:
    lines = [f"## {title}", ""]
    if result is None:
        return lines + [f"Not measured yet: `PIECES={name} scripts/serving_report.sh`.", ""]
    return lines + [what, "", f"Measured at {provenance_text(result)}.{_partial(result)}", "", *compare_table(result), "",
                    *peers_notes(result), *failure_notes(result),
                    ""]


def prefix_lines(served: Optional[dict], engine: Optional[dict]) -> list[str]:
    lines = ["## Prefix caching", ""]
    if served is not None:
        lines += ["Served: vLLM's prefix-repetition workload (one 512-token prefix, 16-token suffixes) against "
                  "`kvlab serve` with prefix caching on (`kvlab`) and off (`--no-enable-prefix-caching`), the two "
                  f"servers taking turns. Measured at {provenance_text(served)}.", "", *compare_table(served), ""]
        on = next(p for p in served["peers"] if p["name"] == "kvlab")
        off = next((p for p in served["peers"] if p["name"] == "kvlab-no-prefix-cache" and p["status"] == "ran"),
                   None)
        for cell in served["cells"] if off else []:
            a, b = run_of(on, cell), run_of(off, cell)
            if a and b and a.get("mean_ttft_ms") and b.get("mean_ttft_ms"):
                lines.append(f"- concurrency {cell['max_concurrency']}: mean TTFT {b['mean_ttft_ms']:.0f} ms without "
                             f"the prefix cache, {a['mean_ttft_ms']:.0f} ms with it: **"
                             f"{b['mean_ttft_ms'] / a['mean_ttft_ms']:.1f}x**; output throughput "
                             f"{cell['kvlab_over_peer'].get('kvlab-no-prefix-cache', 0):.2f}x.")
        lines.append("")
    if engine is not None:
        med = engine["median_ttft_after_first_s"]
        lines += [f"Engine alone (`kvlab bench prefix-ttft`, requests one at a time, {engine['prefix_tokens']}-token "
                  f"prefix, {engine['suffix_tokens']}-token suffixes, median of requests 2..{engine['requests']}): "
                  f"{1000 * med['prefix_caching']:.0f} ms with prefix caching against "
                  f"{1000 * med['no_prefix_caching']:.0f} ms without, **{engine['speedup']:.1f}x** "
                  f"({provenance_text(engine)}).", ""]
    if served is None and engine is None:
        lines += ["Not measured yet: `PIECES=\"prefix ttft\" scripts/serving_report.sh`.", ""]
    return lines


def reliability_lines(r: Optional[dict]) -> list[str]:
    lines = ["## Reliability", ""]
    if r is None:
        return lines + ["Not measured yet: `PIECES=reliability scripts/serving_report.sh`.", ""]
    after = r["server_after"]
    return lines + [
        f"`kvlab bench reliability`: one `kvlab serve {r['model']}` process, a warm-up load, then "
        f"{r['requests_sent']:,} streamed requests at concurrency {r['max_concurrency']} with random short lengths, "
        f"{100 * r['disconnect_fraction']:.0f}% of the clients hanging up mid-stream ({provenance_text(r)}). "
        "tests/reliability asserts the same in CI on stories260K.", "",
        *table(["requests sent", "completed", "cancelled by the client", "failed", "lost", "HTTP statuses",
                "running / waiting after", "KV pool used after", "RSS after warm-up", "RSS after the load"],
               [[f"{r['requests_sent']:,}", f"{r['completed']:,}", f"{r['cancelled']:,}", r["failed"], r["lost"],
                 ", ".join(f"{k}: {v:,}" for k, v in r["status_counts"].items()),
                 f"{after['num_requests_running']:.0f} / {after['num_requests_waiting']:.0f}",
                 f"{100 * after['kv_cache_usage_perc']:.1f}%", f"{r['rss_after_warmup_bytes'] / 2**20:.0f} MiB",
                 f"{r['rss_after_load_bytes'] / 2**20:.0f} MiB ({100 * r['rss_change_fraction']:+.1f}%)"]],
               "rrrrrlrrrr"), "",
        f"The server generated {r['generation_tokens_during_load']:,.0f} tokens during the load; the clients counted "
        f"{r['client_counted_output_tokens']:,} in completed requests (the difference went to clients that hung up). "
        f"Output throughput {r['output_throughput']:.0f} tok/s, p99 end-to-end latency {r['p99_e2el_ms']:.0f} ms.", ""]


def interop_lines(r: Optional[dict]) -> list[str]:
    lines = ["## vLLM's own client against kvlab serve", ""]
    if r is None:
        return lines + ["Not measured yet: `kvlab bench vllm-interop --json "
                        "reports/serving/vllm_interop.json` (needs the vLLM venv).", ""]
    lines += [f"`kvlab bench vllm-interop`: vLLM's `vllm bench serve` (from the venv) and `kvlab bench "
              f"serve` on the same workload and seed against one `kvlab serve {r['model']}`, {r['num_prompts']} "
              f"requests of {r['output_len']} tokens at each concurrency ({provenance_text(r)}). Served one at a time, every "
              "ratio is judged; under load only output tok/s is, and the TTFT/TPOT ratios (in parentheses) show how "
              "differently the two closed loops happened to batch their requests (kvlab.bench.vllm_interop says why).",
              ""]
    rows = []
    for p in r["pairs"]:
        v, k, q = p["vllm"], p["kvlab"], p["vllm_over_kvlab"]
        agreed = p.get("agreed", COMPARED)  # files from before the split by concurrency judged every ratio
        cells = ["-" if q[m] is None else f"{q[m]:.2f}" if m in agreed else f"({q[m]:.2f})" for m in COMPARED]
        rows.append([p["dataset"], p.get("endpoint", "/v1/completions"), p.get("max_concurrency", r["max_concurrency"]),
                     f"{v['completed']} / {v['failed']}", f"{k['completed']} / {k['failed']}",
                     f"{v['total_output_tokens']}, {k['total_output_tokens']}", *cells])
    lines += table(["dataset", "endpoint", "conc.", "vLLM client ok / failed", "kvlab client ok / failed",
                    "tokens (vLLM, kvlab)", "vLLM / kvlab: output tok/s", "mean TTFT", "median TTFT", "mean TPOT",
                    "median TPOT", "mean ITL"], rows, "ll" + "r" * 10)
    u = r["unstreamed"]
    lines += ["", f"Unstreamed (`stream: false`, the openai client): {u['requests'] - u['failed']} ok, {u['failed']} "
              f"failed, completion tokens {sorted(set(u['completion_tokens']))}. Verdict with tolerance "
              f"{r['tolerance']}x on every judged ratio: **{'passed' if r['passed'] else 'failed'}**.", ""]
    return lines


def decode_lines(d: Optional[dict]) -> list[str]:
    lines = ["## Offline decode and prefill against batch and context", ""]
    if d is None:
        return lines + ["Not measured yet: `PIECES=decode scripts/serving_report.sh`.", ""]
    engines = d["engines"]
    rounds = d.get("rounds", 1)
    turns = ("the engines in turn at each point, one round" if rounds == 1 else
             f"the engines in turn at each point, {rounds} rounds, each engine's fastest prefill and fastest "
             "decode kept (every round's times are in the JSON)")
    lines += [f"`kvlab bench decode {d['model']} --rounds {rounds}`: greedy, {d['new_tokens']} new tokens per "
              f"sequence, {turns}; decode as a ratio to kvlab and as a fraction of kvlab.plan's bandwidth roofline "
              f"(weights kvlab reads, {d['weight_bytes_read_per_step'] / 2**20:.0f} MiB a step, plus the KV "
              f"caches, at {d['bandwidth_gbs']} GB/s, {d['bandwidth_source']}). {provenance_text(d)}.", ""]
    rows = []
    for p in d["points"]:
        cells = []
        for e in engines:
            x = p["engines"][e]
            cells.append("-" if x["decode_tokens_per_s"] is None else
                         f"{x['decode_tokens_per_s']:,.1f} ({x['decode_ratio_to_kvlab']:.2f}x, "
                         f"{100 * x['decode_roofline_fraction']:.0f}%)")
        for e in engines:
            x = p["engines"][e]
            cells.append(f"{x['prefill_tokens_per_s']:,.0f} ({x['prefill_ratio_to_kvlab']:.2f}x)")
        rows.append([p["batch"], p["context"], f"{p['roofline_decode_tokens_per_s']:,.0f}", *cells])
    head = ["batch", "context", "roofline tok/s", *(f"{e} decode tok/s" for e in engines),
            *(f"{e} prefill tok/s" for e in engines)]
    lines += table(head, rows, "r" * len(head))
    note = ("" if rounds > 1 else " With one round, a few seconds' stall of this shared machine during a run "
            "reads as that engine's speed at that point: a figure far off its neighbours is more likely that than "
            "the engine.")
    return lines + ["", "Each cell: rate (ratio to kvlab at that point, fraction of the roofline)." + note, ""]


def render(folder: Path) -> str:
    lines = ["# Serving: kvlab against llama.cpp's, transformers' and vLLM's servers (SmolLM2-135M-Instruct)", "",
             "<!-- Written by `kvlab report serving` from the JSON files here. -->", "",
             "Regenerate everything (each piece under `flock /tmp/kvlab-heavy.lock`; `PIECES=\"kv spec\"` runs "
             "some). The 1,024-token sweep prefills about 57,000 prompt tokens per server and is by far the longest "
             "piece; vLLM compiles for 2.5-6 minutes each time it starts:", "", "```bash",
             "scripts/setup_vllm_venv.sh   # once: the vLLM peer",
             "scripts/serving_report.sh", "```", "",
             "Every server gets the same requests from one seed, through the same client (`kvlab bench serve`'s, "
             "streaming, vLLM's metric definitions), greedy, asking for exactly the output length (ignore_eos where "
             "the server takes it; transformers' server refuses vLLM's extra fields with a 422, so it is asked "
             "without them and may stop early: the *tokens back* column shows what came back). All servers are up "
             "at once and take turns at each (prompt length, concurrency) cell, the others paused (SIGSTOP), so the "
             "ratios compare like with "
             "like within one run. kvlab and llama.cpp serve the same Q4_1 GGUF; transformers and vLLM serve "
             "kvlab's HF export of it (bf16). Requests per level: max(4, concurrency). Times in ms. *load before* is "
             "the machine's 1-minute load average as the cell began: this 2-core machine is shared, and a figure "
             "well above 1 means other work ran beside the benchmark (the lock every benchmark here takes does not "
             "bind every process), so compare ratios within a cell rather than figures across runs.", ""]
    for length in (128, 1024):
        result = _load(folder, f"compare_peers{length}.json")
        lines += [f"## Peers, {length}-token prompts", ""]
        if result is None:
            lines += [f"Not measured yet: `PIECES=peers{length} scripts/serving_report.sh`.", ""]
            continue
        lines += [f"Measured at {provenance_text(result)}.{_partial(result)}", "", *compare_table(result), "",
                  *peers_notes(result), *failure_notes(result), "",
                  *target_lines(result), ""]
    for prompts, name, piece in (("128-token prompts", "compare_llama_server.json", "llamaserver"),
                                 ("1024-token prompts", "compare_llama_server_1024.json", "llamaserver1024"),
                                 ("ShareGPT first turns", "compare_llama_server_sharegpt.json", "llamaserversharegpt")):
        llama_server = _load(folder, name)
        lines += llama_server_section(llama_server, compare_table(llama_server) if llama_server else [], prompts,
                                      piece)
    gemma = _load(folder, "compare_gemma.json")
    lines += gemma_section(gemma, compare_table(gemma) if gemma else [])
    lines += gemma_bound_lines(_load(folder, "serving_bound_gemma.json"), gemma)
    a8 = _load(folder, "compare_a8.json")
    lines += variant_section(a8, "int8 activations (`--weights gguf-a8`) against llama.cpp's serialised server",
                             "`kvlab serve --kv-cache-dtype fp16 --weights gguf-a8` (`kvlab`): the 4-bit blocks' "
                             "products on int8 activations, as llama.cpp's own are, against llama.cpp's server with "
                             "`--interrupt_requests False`, the best peer above, at concurrency 16, taking turns. "
                             "(int8 activations cost SmolLM2 0.40% of perplexity and flip near-tied tokens; the "
                             "project README says more.)", "a8")
    lines += [*target_lines(a8), ""] if a8 is not None else []
    seats = _load(folder, "compare_seats.json")
    lines += variant_section(seats, "Seats against latency: `--max-num-seqs` at concurrency 16",
                             "`kvlab serve --kv-cache-dtype fp16 --weights gguf-a8` with its default 64 seats "
                             "(`kvlab`) and with `--max-num-seqs 4, 6, 8` (`kvlab-seats-N`, with `--max-wait-ms 500` so "
                             "a wave's requests start together), and with 64 seats streaming four tokens per event "
                             "(`kvlab-stream-4`, `--stream-interval 4`: its ITL is a chunk's), against llama.cpp's "
                             "serialised server, taking turns. "
                             "A batch's step costs more per row on two CPU cores, so every seat added buys throughput "
                             "with TPOT, while a server that decodes one request at a time has batch 1's TPOT and "
                             "pays for it in TTFT.", "seats")
    lines += seats_lines(seats)
    lines += bound_lines(_load(folder, "serving_bound.json"), seats)
    lines += variant_section(_load(folder, "compare_kv.json"), "KV cache formats: fp16 against fp8 and int8",
                             "`kvlab serve` three times, `--kv-cache-dtype fp16` (`kvlab`), `fp8` and `int8`, taking "
                             "turns; *kvlab / it* is fp16's throughput over the variant's.", "kv")
    lines += prefix_lines(_load(folder, "compare_prefix.json"), _load(folder, "prefix_ttft_smollm2.json"))
    lines += variant_section(_load(folder, "compare_spec.json"), "Speculative decoding on and off",
                             "`kvlab serve` without (`kvlab`) and with `--speculative-config '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}'` on the random workload, taking turns. n-gram lookup drafts from "
                             "the request's own tokens, so what it gains depends on how much the model's greedy "
                             "continuation repeats them; reports/speculative has acceptance rates on chat and "
                             "predictable text.", "spec")
    lines += interop_lines(_load(folder, "vllm_interop.json"))
    lines += lm_eval_lines(_load(folder, "lm_eval.json"))
    lines += structured_lines(_load(folder, "structured.json"))
    lines += plain_lines(_load(folder, "compare_plain.json"))
    lines += reliability_lines(_load(folder, "reliability.json"))
    lines += decode_lines(_load(folder, "decode_sweep.json"))
    lines += ["## For users who scale out", "",
              "The same comparison on a GPU machine: start vLLM (`vllm serve DIR` or `python -m "
              "vllm.entrypoints.openai.api_server --model DIR`) and point either client at it: "
              "`kvlab bench serve --base-url http://HOST:8000 --model DIR --max-concurrency 1,4,16,32`, or vLLM's own "
              "`vllm bench serve --base-url http://HOST:8000 --model DIR --dataset-name random --max-concurrency 16`. "
              "`kvlab bench compare MODEL --peer NAME=COMMAND` starts any other server with `{port}` in its command.",
              ""]
    return "\n".join(lines)


def write(folder: Path) -> Path:
    """README.md in `folder`, rendered from the JSON there and written atomically."""
    return write_atomic(folder / "README.md", render(folder))
