"""Regenerate reports/fleet/: worked examples, the day-long speed run, figures, and the README.

    python3 scripts/fleet_report.py              # examples + speed run + README (reuses validation.json)
    python3 scripts/fleet_report.py --validate   # first re-measure: kvlab fleet calibrate + scripts/fleet_validate.py
    python3 scripts/fleet_report.py --render     # only rewrite README.md from the JSON files
    (--skip-day and --day-only split the run in two, each under ten minutes; --speculative-only redoes the
    draft-model example alone)

Run it alone (the speed run and the validation measure): flock /tmp/kvlab-heavy.lock python3 scripts/fleet_report.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
OUT = ROOT / "reports" / "fleet"

from kvlab.bench.provenance import provenance  # noqa: E402
from kvlab.cli import build_parser  # noqa: E402
from kvlab.commands.fleet_scenario import scenario_from_args  # noqa: E402
from kvlab.commands.plan_args import model_from_args, request_from_args  # noqa: E402
from kvlab.fleet.step_cost import (DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_COMPUTE_EFFICIENCY,  # noqa: E402
                                   DEFAULT_STEP_OVERHEAD_S, EFFICIENCY_SOURCES)
from kvlab.plan.planner import plan  # noqa: E402

PRICE_H100_HOUR = 2.50  # USD per card-hour: an illustrative input, not a quote; replace with yours
PRICE_PER_MTOK = 0.90  # USD per million output tokens on a shared pay-per-token pool: illustrative too
DATACENTRE = ("llama-3-70b --gpu h100 --rate 50 --duration 60 --prompt-len 4096 --output-len 512 "
              f"--slo ttft:2000 tpot:50 --find-min-cards --price-per-card-hour {PRICE_H100_HOUR} "
              f"--price-per-mtok {PRICE_PER_MTOK} --seed 0")
VARIANTS = (("MHA", "--kv-heads 64"), ("GQA-8", ""), ("MLA 512+64", "--mla-rank 512 --mla-rope-dim 64"))
DTYPES = ("fp16", "fp8")
EDGE = ("smollm2-135m --gpu jetson-agx-orin-64gb --rate 10 --burstiness inf --duration 60 --prompt-len 32 "
        "--output-len 8 --prefix-fraction 1 --prefix-len 1536 --max-num-seqs 8 --slo e2el:50 --seed 0")
DRAFT = "reports/fleet/llama-3.2-1b"  # Llama-3.2-1B's published config.json shape (16 layers, GQA-8, 1.24B)
SPECULATIVE = f"{DATACENTRE} --kv-cache-dtype fp8 --tensor-parallel-size 8"
ACCEPTANCE = (0.5, 0.7, 0.9)
DAY = ("llama-3-8b --gpu h100 --kv-cache-dtype fp8 --rate 100 --duration 86400 --prompt-len uniform:1024:0.5 "
       "--output-len uniform:256:0.5 --replicas {replicas} --tensor-parallel-size {tp} --router least-loaded "
       "--simulator fast --seed 0")


def fleet(command: str, plot: bool = False) -> dict:
    """One `kvlab fleet` run in-process: the same parser and scenario the command line uses."""
    argv = ["fleet"] + command.split()
    args = build_parser("fleet").parse_args(argv)
    scenario = scenario_from_args(args)
    result = scenario.run()
    if plot:
        result["figures"] = [os.path.relpath(p, OUT) for p in scenario.figures(result, str(OUT))]
    result["command"] = "kvlab " + " ".join(argv)
    result["result"].pop("timeline", None)
    return result


def write(name: str, data: dict) -> None:
    path = OUT / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**data, "provenance": provenance()}, indent=2) + "\n")
    tmp.replace(path)


def datacentre() -> None:
    rows = []
    for label, flags in VARIANTS:
        for dtype in DTYPES:
            started = time.perf_counter()
            r = fleet(f"{DATACENTRE} --kv-cache-dtype {dtype} {flags}".strip(), plot=(label, dtype) == ("MHA", "fp16"))
            r["label"], r["kv_dtype"], r["wall_seconds"] = label, dtype, time.perf_counter() - started
            rows.append(r)
            print(f"datacentre {label} {dtype}: {r['min_cards']['cards']} cards", flush=True)
    sweep = fleet(f"{DATACENTRE} --kv-cache-dtype fp8 --sweep-rates 10,25,50,75,100", plot=True)
    write("datacentre.json", {"rows": rows, "sweep": sweep})


def edge() -> None:
    rows = []
    for caching in ("", " --no-prefix-caching"):
        r = fleet(EDGE + caching + " --sweep-rates 5,10,20,40,80", plot=not caching)
        r["prefix_caching"] = not caching
        rows.append(r)
    write("edge.json", {"rows": rows})


def speculative() -> None:
    """Llama-3-70B GQA-8 fp8 KV on TP8 replicas, without and with a Llama-3.2-1B draft (k = 4) at three
    acceptance rates: the fewest replicas for the SLO, the tails, the bill."""
    rows = []
    for a in (None,) + ACCEPTANCE:
        flags = "" if a is None else f" --draft {DRAFT} --acceptance-rate {a} --num-speculative-tokens 4"
        started = time.perf_counter()
        r = fleet(SPECULATIVE + flags)
        r["acceptance_rate"], r["wall_seconds"] = a, time.perf_counter() - started
        if a is not None:  # the planner's batch-1 figures for the same draft, for comparison
            argv = ["plan", "llama-3-70b", "--gpu", "h100", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "8",
                    "--draft", DRAFT, "--acceptance-rate", str(a), "--num-speculative-tokens", "4"]
            args = build_parser("plan").parse_args(argv)
            r["plan_speculative"] = plan(model_from_args(args), request_from_args(args))["speculative"]
            r["plan_command"] = "kvlab " + " ".join(argv)
        rows.append(r)
        print(f"speculative a={a}: {r['min_cards']['cards']} cards", flush=True)
    write("speculative.json", {"rows": rows})


def day() -> None:
    """A day at 100 req/s: the fleet sized on ten minutes of the same traffic, then the whole day, timed."""
    sizing = fleet(DAY.format(replicas=1, tp=1).replace("--duration 86400", "--duration 600").replace(
        "--replicas 1 --tensor-parallel-size 1", "--slo ttft:2000 tpot:50 --find-min-cards").replace(
        " --simulator fast", ""))
    replicas, tp = sizing["min_cards"]["replicas"], sizing["replica"]["cards"]
    started = time.perf_counter()
    r = fleet(DAY.format(replicas=replicas, tp=tp))
    r["total_wall_seconds"] = time.perf_counter() - started
    r["sized_on"] = sizing["command"]
    write("day.json", r)
    print(f"day: {r['result']['requests']:,} requests in {r['total_wall_seconds']:.0f} s", flush=True)


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def render() -> None:
    def load(name):
        path = OUT / name
        return json.loads(path.read_text()) if path.exists() else None

    val, dc, ed, dy, cal = (load("validation.json"), load("datacentre.json"), load("edge.json"), load("day.json"),
                            load("calibration-smollm2.json"))
    sp = load("speculative.json")
    lines = ["# kvlab fleet: sizing a serving fleet by simulating the engine's own scheduler", "",
             "Regenerate everything (re-measures the validation, then the examples and the day run):",
             "`flock /tmp/kvlab-heavy.lock python3 scripts/fleet_report.py --validate`; without `--validate` "
             "the measured validation.json is reused; `--render` only rewrites this file from the JSON files.",
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
                  f"(`python3 scripts/fleet_validate.py`). Simulated capacity {val['simulated_capacity_req_s']:.2f} "
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
        lines += ["Not measured yet: run `flock /tmp/kvlab-heavy.lock python3 scripts/fleet_report.py --validate`.", "",
                  "VALIDATION_STATUS", ""]
    lines += ["## Default efficiency factors (the roofline, when no --calibration is given)", "",
              f"- bandwidth efficiency {DEFAULT_BANDWIDTH_EFFICIENCY}: {EFFICIENCY_SOURCES['bandwidth']}",
              f"- compute efficiency {DEFAULT_COMPUTE_EFFICIENCY}: {EFFICIENCY_SOURCES['compute']}",
              f"- step overhead {DEFAULT_STEP_OVERHEAD_S * 1e3:g} ms: {EFFICIENCY_SOURCES['overhead']}",
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
                  f"[Llama-3.2-1B's config shape]({os.path.relpath(ROOT / DRAFT, OUT)}/config.json) with k = 4 "
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
    notes = (OUT / "notes.md").read_text() if (OUT / "notes.md").exists() else ""
    parts = dict(p.split("\n", 1) for p in notes.split("<!-- ")[1:]) if notes else {}
    for key in ("VALIDATION_NOTES", "VALIDATION_STATUS", "SIMULATOR_NOTES"):
        text = text.replace(key, parts.get(key + " -->", "").strip())
    tmp = OUT / "README.md.tmp"
    tmp.write_text(text + "\n")
    tmp.replace(OUT / "README.md")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", action="store_true", help="re-run the calibration and the validation first")
    parser.add_argument("--render", action="store_true", help="only rewrite README.md from the JSON files")
    parser.add_argument("--skip-day", action="store_true", help="keep day.json (the longest part)")
    parser.add_argument("--day-only", action="store_true", help="only the day-long speed run, then the README")
    parser.add_argument("--speculative-only", action="store_true",
                        help="only the speculative-decoding example (about two minutes), then the README")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # the commands name repository paths (the draft's config.json)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if args.validate:
        subprocess.run([sys.executable, "-m", "kvlab.cli", "fleet", "calibrate", "smollm2-135m", "--kv-cache-memory",
                        "1GiB", "--output", str(OUT / "calibration-smollm2.json")], check=True, env=env)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "fleet_validate.py")], check=True, env=env)
    if args.day_only:
        day()
    elif args.speculative_only:
        speculative()
    elif not args.render:
        datacentre()
        speculative()
        edge()
        if not args.skip_day:
            day()
    render()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
