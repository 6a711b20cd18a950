"""reports/fleet/README.md: the fleet simulator's validation, worked examples and speed, from the JSON beside it.

Renders calibration-smollm2.json (`kvlab fleet calibrate`), validation.json (`kvlab bench
fleet-validate`), datacentre.json, speculative.json, edge.json and day.json (`kvlab bench
fleet-report`), and places the hand-written sections of notes.md where their markers stand. It
measures nothing and imports no simulator: the efficiency factors the roofline ran with are read
from the data-centre runs' JSON, the command lines from kvlab.bench.fleet_examples.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.bench.fleet_examples import DATACENTRE, DRAFT, PRICE_H100_HOUR, PRICE_PER_MTOK, SPECULATIVE


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def render(out: Path) -> str:
    """The page of the report folder `out`; a section whose JSON is missing is left out."""
    out = Path(out)

    def load(name):
        path = out / name
        return json.loads(path.read_text()) if path.exists() else None

    val, dc, ed, dy, cal = (load("validation.json"), load("datacentre.json"), load("edge.json"), load("day.json"),
                            load("calibration-smollm2.json"))
    sp = load("speculative.json")
    lines = ["# kvlab fleet: sizing a serving fleet by simulating the engine's own scheduler", "",
             "Regenerate everything (re-measures the validation, then the examples and the day run):",
             "`flock /tmp/kvlab-heavy.lock kvlab bench fleet-report --validate`; without `--validate` "
             "the measured validation.json is reused; `kvlab report fleet` only rewrites this file from the JSON "
             "files.",
             "Every number below is read from the JSON files beside this README (each with provenance).", ""]
    lines += ["## Validation against the real engine on this machine", ""]
    if cal:
        f, q, e = cal["fit"], cal["fit_quality"], cal["engine"]
        lines += [f"Calibration (`kvlab fleet calibrate smollm2-135m --kv-cache-memory 1GiB`, "
                  f"[calibration-smollm2.json](calibration-smollm2.json), {cal['provenance']['time_utc']}, "
                  f"{e['threads']} torch threads, {e['decode_path']}): decode step "
                  f"{f['decode_base'] * 1e3:.2f} ms + {f['decode_per_seq'] * 1e3:.3f} ms per sequence + "
                  f"{f['decode_per_ctx'] * 1e6:.3f} us per context token (median fit error "
                  f"{q['decode_median_abs_error']:.0%}); step with prefill {f['mixed_base'] * 1e3:.2f} ms + "
                  f"{f['mixed_per_token'] * 1e3:.3f} ms per token + {f['mixed_per_pair'] * 1e9:.2f} ns per "
                  f"attention pair (median error {q['prefill_median_abs_error']:.0%}). Pool "
                  f"{e['num_blocks']:,} blocks of {e['block_size']}, {e['max_num_seqs']} seats, "
                  f"{e['max_num_batched_tokens']} tokens per step.", ""]
    if val:
        w = val["workload"]
        lines += [f"Workload: `kvlab bench serve` random dataset, {w['input_len']} prompt tokens and "
                  f"{w['output_len']} output tokens each uniform within +-{w['range_ratio']:.0%}, --ignore-eos, "
                  f"Poisson arrivals, seed {w['seed']}, against `kvlab serve smollm2-135m` with the calibration's "
                  f"settings; the simulator runs the same arrivals and lengths on the engine's Scheduler "
                  f"(`kvlab bench fleet-validate`). Simulated capacity {val['simulated_capacity_req_s']:.2f} "
                  "req/s. Targets: throughput within 10% and p95 TTFT within 25% at low and medium load.", "",
                  "| load | rate req/s | prompts | throughput meas / pred | p50 TTFT ms meas / pred | "
                  "p95 TTFT ms meas / pred | p50 TPOT ms meas / pred | p95 TPOT ms meas / pred | "
                  "throughput err | p95 TTFT err |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in val["rows"]:
            m, p, e = row["measured"], row["predicted"], row["errors"]
            lines.append(f"| {row['workload']} | {row['rate']:.2f} | {row['num_prompts']} | "
                         f"{m['request_throughput']:.3f} / {p['request_throughput']:.3f} | "
                         f"{_ms(m['p50_ttft_ms'])} / {_ms(p['p50_ttft_ms'])} | "
                         f"{_ms(m['p95_ttft_ms'])} / {_ms(p['p95_ttft_ms'])} | "
                         f"{_ms(m['p50_tpot_ms'])} / {_ms(p['p50_tpot_ms'])} | "
                         f"{_ms(m['p95_tpot_ms'])} / {_ms(p['p95_tpot_ms'])} | "
                         f"{e.get('request_throughput', 0):+.0%} | {e.get('p95_ttft_ms', 0):+.0%} |")
        verdicts = []
        for row in val["rows"]:
            e = row["errors"]
            if row["workload"] in val["targets"]["at"]:
                tp_ok = abs(e.get("request_throughput", 1)) <= val["targets"]["request_throughput"]
                ttft_ok = abs(e.get("p95_ttft_ms", 1)) <= val["targets"]["p95_ttft_ms"]
                verdicts.append(f"{row['workload']}: throughput {'within' if tp_ok else 'MISSES'} 10% "
                                f"({e.get('request_throughput', 0):+.1%}), p95 TTFT "
                                f"{'within' if ttft_ok else 'MISSES'} 25% ({e.get('p95_ttft_ms', 0):+.1%})")
        lines += ["", "Against the targets: " + "; ".join(verdicts) + "."]
        inproc = [row for row in val["rows"] if "engine_only" in row]
        if inproc:
            lines += ["", "The same requests through the engine in one process (no HTTP server, no benchmark client; "
                      "arrivals replayed in real time), against the simulator:", "",
                      "| load | throughput engine / pred | p50 TTFT ms engine / pred | p95 TTFT ms engine / pred | "
                      "p50 TPOT ms engine / pred | p95 TPOT ms engine / pred | throughput err | p95 TTFT err |",
                      "|---|---|---|---|---|---|---|---|"]
            for row in inproc:
                m, p, e = row["engine_only"], row["predicted"], row["errors_vs_engine_only"]
                lines.append(f"| {row['workload']} | {m['request_throughput']:.3f} / {p['request_throughput']:.3f} | "
                             f"{_ms(m['p50_ttft_ms'])} / {_ms(p['p50_ttft_ms'])} | "
                             f"{_ms(m['p95_ttft_ms'])} / {_ms(p['p95_ttft_ms'])} | "
                             f"{_ms(m['p50_tpot_ms'])} / {_ms(p['p50_tpot_ms'])} | "
                             f"{_ms(m['p95_tpot_ms'])} / {_ms(p['p95_tpot_ms'])} | "
                             f"{e['request_throughput']:+.0%} | {e['p95_ttft_ms']:+.0%} |")
            loads = ", ".join(f"{row['workload']} {row['load_average_1min'][0]:.2f} to {row['load_average_1min'][1]:.2f}"
                              for row in val["rows"] if "load_average_1min" in row)
            lines += ["", f"1-minute load average before and after each server run: {loads}."]
        lines += ["", "VALIDATION_NOTES", ""]
    else:
        lines += ["Not measured yet: run `flock /tmp/kvlab-heavy.lock kvlab bench fleet-report --validate`.", "",
                  "VALIDATION_STATUS", ""]
    # the factors the data-centre runs' roofline used, as their JSON recorded them (kvlab.fleet.step_cost's defaults)
    roofline = next((r for r in dc["rows"] if "efficiency_sources" in r), None) if dc else None
    if roofline:
        cost, sources = roofline["replica"]["cost"], roofline["efficiency_sources"]
        lines += ["## Default efficiency factors (the roofline, when no --calibration is given)", "",
                  f"- bandwidth efficiency {cost['bandwidth_efficiency']}: {sources['bandwidth']}",
                  f"- compute efficiency {cost['compute_efficiency']}: {sources['compute']}",
                  f"- step overhead {cost['step_overhead_s'] * 1e3:g} ms: {sources['overhead']}",
                  "- datasheet bandwidth and dense TFLOP/s: kvlab.plan.hardware (the vendors' datasheets, as "
                  "../shared/reference/ANCHORS.md lists them). Tensor-parallel communication is not modelled, so "
                  "larger tensor-parallel degrees look better than they are.", ""]
    if dc:
        lines += ["## Data centre: Llama-3-70B on H100 SXM at 50 requests/s, 4,096-token prompts, 512-token answers",
                  "", f"SLO: p95 TTFT <= 2 s and p95 TPOT <= 50 ms. Prices are illustrative inputs: "
                  f"${PRICE_H100_HOUR}/card-hour dedicated, ${PRICE_PER_MTOK} per million output tokens pay-per-token. "
                  "KV what-ifs change only the cache (the planner's convention: weights stay Llama-3-70B's). "
                  "Each row: `kvlab " + " ".join(("fleet " + DATACENTRE).split()) + " --kv-cache-dtype D [variant]`.",
                  "", "| attention | KV dtype | KV/token/card | fewest cards (weights + one request) | "
                  "KV seats per replica at 4,608 tokens | replica | cards for SLO | p95 TTFT ms | p95 TPOT ms | "
                  "$/M output tok | pay-per-token break-even |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in dc["rows"]:
            rep, res = r["replica"], r["result"]
            seats = rep["kv_tokens"] // (4096 + 512)
            lines.append(f"| {r['label']} | {r['kv_dtype']} | {rep['kv_bytes_per_token_per_rank'] / 1024:,.0f} KiB | "
                         f"{r['cards_for_weights']} | {seats:,} on TP{rep['cards']} (seat cap {rep['max_num_seqs']}) | "
                         f"TP{rep['cards']} x {res['replicas']} | {res['cards']} | {_ms(res['ttft_ms']['p95'])} | "
                         f"{_ms(res['tpot_ms']['p95'])} | {res['cost']['dedicated_per_mtok']:.2f} | "
                         f"{res['cost']['break_even_rate']:.0f} req/s |")
        mha = next((r for r in dc["rows"] if r.get("figures")), None)
        lines += ["", "GQA-8 with fp8 KV against the arrival rate (each point its own fewest-cards fleet), and the "
                  "KV pool over time for the chosen GQA-8 fleet and for MHA in fp16, where the cache binds:", "",
                  "![latency and cards against rate](" + dc["sweep"]["figures"][-1] + ")",
                  "![KV pool over time, GQA-8 fp8](" + dc["sweep"]["figures"][0] + ")"]
        if mha:
            lines.append("![KV pool over time, MHA fp16](" + mha["figures"][0] + ")")
        lines.append("")
    if sp:
        lines += ["## Speculative decoding: the same Llama-3-70B fleet with a Llama-3.2-1B draft", "",
                  "GQA-8 with fp8 KV on TP8 replicas, the workload and SLO above; the draft is "
                  f"[Llama-3.2-1B's config shape]({DRAFT.rsplit('/', 1)[-1]}/config.json) with k = 4 "
                  "drafted tokens. Its weights (1.24B parameters, bf16) and KV share the cards, so each block "
                  "holds both caches and the replica has fewer; a step costs up to 4 draft rounds on the same "
                  "roofline plus a target pass over 5 tokens per sequence, and emits min(G, 4) + 1 tokens "
                  "(G geometric). Acceptance rates are inputs, not measured here. Each row: `kvlab "
                  + " ".join(("fleet " + SPECULATIVE).split()) + " [--draft "
                  f"{DRAFT} --acceptance-rate A --num-speculative-tokens 4]`.", "",
                  "| draft | acceptance | tokens/step expected / drawn | KV blocks per replica | cards for SLO | "
                  "p95 TTFT ms | p50 TPOT ms | p95 TPOT ms | $/M output tok | p50 TPOT gain here | "
                  "batch-1 speed-up (`kvlab plan`) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        base = sp["rows"][0]["result"]["tpot_ms"]["p50"]
        for r in sp["rows"]:
            rep, res = r["replica"], r["result"]
            s = res.get("speculative")
            tokens = "1 / 1" if s is None else (f"{s['expected_tokens_per_step']:.2f} / "
                                                f"{s['mean_tokens_per_step']:.2f}")
            batch1 = f"{r['plan_speculative']['expected_speedup']:.2f}x" if s else "-"
            lines.append(f"| {'none' if s is None else s['draft']} | {'-' if s is None else s['acceptance_rate']} | "
                         f"{tokens} | {rep['num_blocks']:,} | {res['cards']} | {_ms(res['ttft_ms']['p95'])} | "
                         f"{_ms(res['tpot_ms']['p50'])} | {_ms(res['tpot_ms']['p95'])} | "
                         f"{res['cost']['dedicated_per_mtok']:.2f} | {base / res['tpot_ms']['p50']:.2f}x | {batch1} |")
        lines += ["", "The batch-1 speed-up is the paper's formula with the draft's cost as its share of the weight "
                  "bytes (`" + sp["rows"][-1]["plan_command"] + "`, each acceptance rate). In the fleet a replica "
                  "verifies dozens of sequences at once: the target's pass over 5 tokens each is priced by the "
                  "roofline's compute side, and every draft round adds its per-step overhead, so the gain per "
                  "token is what the TPOT column shows.", ""]
    if ed:
        lines += ["## Edge: SmolLM2-135M on a Jetson AGX Orin serving one robot's action loop", "",
                  "A control loop at 10 Hz (constant gaps: `--burstiness inf`), every request the same 1,536-token "
                  "instructions plus a 32-token observation, 8-token actions, budget p95 end-to-end <= 50 ms. "
                  "Roofline on Orin's datasheet (204.8 GB/s, about 42.5 dense TFLOP/s) with the default "
                  "efficiencies.", "", "| prefix caching | p50 TTFT ms | p95 TTFT ms | p95 E2EL ms | "
                  "meets 50 ms | prefix hit rate |", "|---|---|---|---|---|---|"]
        for r in ed["rows"]:
            res = r["result"]
            lines.append(f"| {'on' if r['prefix_caching'] else 'off'} | {_ms(res['ttft_ms']['p50'])} | "
                         f"{_ms(res['ttft_ms']['p95'])} | {_ms(res['e2el_ms']['p95'])} | "
                         f"{'yes' if res['meets_slo'] else 'no'} | {res['prefix_cache_hit_rate']:.0%} |")
        lines += ["", "Loop rate sweep (prefix caching on): " + "; ".join(
            f"{s['rate']:g} Hz p95 E2EL {_ms(s['e2el_ms']['p95'])} ms" for s in ed["rows"][0]["sweep"]) + ".", "",
            "![edge latency against loop rate](" + ed["rows"][0]["figures"][-1] + ")", ""]
    if dy:
        res = dy["result"]
        lines += ["## Speed: a day of traffic at 100 requests/s", "",
                  f"`{dy['command']}` (fleet size from `{dy['sized_on']}`): {res['requests']:,} requests, "
                  f"{res['engine_steps']:,} engine steps over {res['replicas']} replicas, simulated in "
                  f"{res['wall_seconds']:.0f} s ({dy['total_wall_seconds']:.0f} s with drawing the workload and "
                  f"the summary) on this machine ({dy['provenance']['machine']['cpu']}), fast path. "
                  f"p95 TTFT {_ms(res['ttft_ms']['p95'])} ms, p95 TPOT {_ms(res['tpot_ms']['p95'])} ms.", ""]
    lines += ["## How the simulator works, and its limits", "", "SIMULATOR_NOTES", ""]
    text = "\n".join(lines)
    notes = (out / "notes.md").read_text() if (out / "notes.md").exists() else ""
    parts = dict(p.split("\n", 1) for p in notes.split("<!-- ")[1:]) if notes else {}
    for key in ("VALIDATION_NOTES", "VALIDATION_STATUS", "SIMULATOR_NOTES"):
        text = text.replace(key, parts.get(key + " -->", "").strip())
    return text + "\n"


def write(out: Path) -> Path:
    from kvlab.files import write_atomic

    return write_atomic(Path(out) / "README.md", render(out))
