"""reports/serving/README.md is rendered from its JSON alone: figures, ratios and the 5x target's verdict."""

from __future__ import annotations

import json

from kvlab.bench.compare import ratios
from kvlab.cli import main
from kvlab.report.serving_report import render

PROV = {"git_commit": "abcdef1234", "git_dirty_files": [], "time_utc": "2026-12-01T12:00:00Z",
        "machine": {"cpu": "CPU", "cores": 2, "torch_threads": 2}}


def _run(level, tps, ttft, tpot):
    return {"input_len": 128, "max_concurrency": level, "completed": level, "failed": 0,
            "total_output_tokens": 24 * level,
            "requested_output_tokens": 24 * level, "output_throughput": tps, "mean_ttft_ms": ttft, "p99_ttft_ms": ttft,
            "mean_tpot_ms": tpot, "p99_tpot_ms": tpot, "mean_itl_ms": tpot}


def _compare(peers):
    result = {"benchmark": "compare", "input_lens": [128], "levels": [16], "peers": peers, "provenance": PROV}
    result["cells"] = ratios(peers, [(128, 16)])
    return result


def test_the_page_states_same_run_ratios_and_the_target(tmp_path):
    peers = [{"name": "kvlab", "status": "ran", "note": "GGUF", "startup_s": 3.0, "vllm_extras": True,
              "runs": [_run(16, 300.0, 200.0, 40.0)]},
             {"name": "llama.cpp-serial", "status": "ran", "note": "GGUF", "startup_s": 1.0, "vllm_extras": True,
              "runs": [_run(16, 50.0, 9000.0, 19.0)]},
             {"name": "transformers", "status": "ran", "note": "HF", "startup_s": 12.0, "vllm_extras": False,
              "runs": [{**_run(16, 0.0, 0.0, 0.0), "completed": 0, "failed": 16,
                        "first_errors": ["no answer within --request-timeout 300 s"]}]},
             {"name": "vllm", "status": "skipped", "reason": "no vLLM venv"}]
    (tmp_path / "compare_peers128.json").write_text(json.dumps(_compare(peers)))
    page = render(tmp_path)
    assert "| 128 | 16 | llama.cpp-serial | 16 / 0 | 384 / 384 | 50.0 | 6.00x | 9,000 |" in page
    assert "**6.00x** the best peer (llama.cpp-serial, 50.0 tok/s): the 5x target is met" in page
    assert "worse than llama.cpp-serial (tpot 19 ms)" in page  # kvlab's p99 TPOT 40 ms > 19 ms
    assert "- vllm: skipped: no vLLM venv" in page
    assert ('- transformers at prompt 128, concurrency 16: 16 of 16 requests failed; the first: "no answer within '
            '--request-timeout 300 s".') in page
    assert "llama.cpp-serial at prompt" not in page  # only cells with failures are listed
    assert "Not measured yet: `PIECES=peers1024 scripts/serving_report.sh`" in page
    assert "commit abcdef1" in page
    assert main(["report", "serving", str(tmp_path)]) == 0 and (tmp_path / "README.md").read_text() == page


def test_latencies_of_a_server_that_cut_answers_off_are_not_held_against_kvlab(tmp_path):
    cut = {**_run(16, 3.5, 5000.0, 14.0), "total_output_tokens": 39}  # 39 of 384 tokens: streams cancelled
    peers = [{"name": "kvlab", "status": "ran", "note": "GGUF", "startup_s": 3.0, "vllm_extras": True,
              "runs": [_run(16, 300.0, 2000.0, 25.0)]},
             {"name": "llama.cpp", "status": "ran", "note": "GGUF", "startup_s": 1.0, "vllm_extras": True,
              "runs": [cut]},
             {"name": "llama.cpp-serial", "status": "ran", "note": "GGUF", "startup_s": 1.0, "vllm_extras": True,
              "runs": [{**_run(16, 50.0, 9000.0, 28.0), "total_output_tokens": 346}]}]  # 90%: compared
    (tmp_path / "compare_peers128.json").write_text(json.dumps(_compare(peers)))
    page = render(tmp_path)
    assert ("p99 TPOT 25.0 ms: no worse than any peer's (latencies not compared for llama.cpp, which sent back "
            "39 of 384 tokens).") in page
    peers[2]["runs"][0]["p99_tpot_ms"] = 24.0
    (tmp_path / "compare_peers128.json").write_text(json.dumps(_compare(peers)))
    assert "worse than llama.cpp-serial (tpot 24 ms) (latencies not compared for llama.cpp" in render(tmp_path)


def test_the_seats_sweep_says_which_setting_meets_both_halves(tmp_path):
    def peer(name, run):
        return {"name": name, "status": "ran", "note": "GGUF", "startup_s": 1.0, "vllm_extras": True, "runs": [run]}

    peers = [peer("kvlab", _run(16, 120.0, 2000.0, 40.0)),
             peer("llama.cpp-serial", {**_run(16, 20.0, 15000.0, 15.0), "total_output_tokens": 378}),
             peer("kvlab-seats-4", _run(16, 100.0, 3000.0, 14.0))]
    (tmp_path / "compare_seats.json").write_text(json.dumps(_compare(peers)))
    page = render(tmp_path)
    assert ("- kvlab: 120.0 tok/s, 6.00x llama.cpp-serial (at least 5x); p99 TPOT 40.0 ms against 15.0 (worse), "
            "p99 TTFT 2000 ms against 15000 (no worse).") in page
    assert "- kvlab-seats-4: 100.0 tok/s, 5.00x llama.cpp-serial (at least 5x); p99 TPOT 14.0 ms" in page
    assert "Prompt 128, concurrency 16: kvlab-seats-4 meets both halves of the target." in page
    peers[2]["runs"][0]["p99_tpot_ms"] = 16.0
    (tmp_path / "compare_seats.json").write_text(json.dumps(_compare(peers)))
    assert "no setting meets both halves of the target in this run." in render(tmp_path)


def test_the_bound_holds_the_c_steps_ceiling_against_the_seats_sweeps_peer(tmp_path):
    def peer(name, run, argv=()):
        return {"name": name, "status": "ran", "note": "GGUF", "startup_s": 1.0, "vllm_extras": True, "runs": [run],
                "argv": ["kvlab", "serve", *argv]}

    peers = [peer("kvlab", _run(16, 100.0, 2500.0, 40.0)),
             peer("llama.cpp-serial", _run(16, 20.0, 15000.0, 13.0)),
             peer("kvlab-seats-4", _run(16, 90.0, 3000.0, 15.0), ["--max-num-seqs", "4"]),
             peer("kvlab-stream-4", _run(16, 104.0, 2500.0, 36.0), ["--stream-interval", "4"])]  # faster at 16
    (tmp_path / "compare_seats.json").write_text(json.dumps(_compare(peers)))
    assert "Not measured yet: `PIECES=bound scripts/serving_report.sh`." in render(tmp_path)
    costs = {"benchmark": "serving_bound", "weights": "gguf-a8", "requests": 16, "input_len": 128, "output_len": 24,
             "repetitions": 5,
             "prefill_ms_per_token": {"1": 1.5, "16": 1.25}, "decode_step_ms": {"1": 8.0, "4": 12.0, "16": 32.0},
             "provenance": PROV}
    (tmp_path / "serving_bound.json").write_text(json.dumps(costs))
    page = render(tmp_path)
    assert "so the target asks for 100.0 tok/s with steps within 13.0 ms." in page
    assert "Each cost is the fastest of 5 interleaved repetitions" in page
    assert "| 4 | 12.0 | kvlab-seats-4 | 15.0 | 90.0 | 3.66 | 104.8 | 5.24x | yes |" in page  # 2.56 s + 4 x 23 x 12 ms
    # the default seats: all 16 rows
    assert "| 16 | 32.0 | kvlab-stream-4 | 36.0 | 104.0 | 3.30 | 116.5 | 5.83x | no |" in page
    assert "| 1 | 8.0 | - | - | - |" in page  # not served in the sweep
    assert "- Throughput alone: 16 seats, at most 116.5 tok/s, at least the 100.0 asked." in page
    assert "- Both halves: 4 seats (the fastest run of those whose step is within 13.0 ms), at most 104.8" in page
    costs["decode_step_ms"] = {"1": 14.0, "16": 40.0}
    (tmp_path / "serving_bound.json").write_text(json.dumps(costs))
    page = render(tmp_path)
    assert "- Both halves: no step here is within 13.0 ms, not even one row's." in page
    assert "- Throughput alone: 16 seats, at most 110.3 tok/s, at least the 100.0 asked." in page
    peers[1]["runs"][0]["output_throughput"] = 25.0  # 125 tok/s asked: 3.072 s, of which 0.92 s decode
    (tmp_path / "compare_seats.json").write_text(json.dumps(_compare(peers)))
    assert ("under the 125.0 asked; it would need prefill at 1.051 ms per prompt token, 1.19x the speed measured."
            in render(tmp_path))


def test_llama_server_verdicts_hold_each_level_to_its_own_target_and_say_when_the_peer_gave_nothing():
    from kvlab.report.serving_llama_server import llama_server_verdicts

    failed = {**_run(32, 0.0, 0.0, 0.0), "completed": 0, "failed": 32}
    peers = [{"name": "kvlab", "status": "ran", "runs": [_run(1, 15.0, 50.0, 10.0), _run(4, 50.0, 1.0, 1.0),
                                                         _run(16, 240.0, 90.0, 40.0), _run(32, 20.0, 9.0, 9.0)]},
             {"name": "llama-server", "status": "ran", "runs": [_run(1, 10.0, 60.0, 11.0), _run(4, 10.0, 1.0, 1.0),
                                                                _run(16, 100.0, 95.0, 50.0), failed]}]
    result = {"peers": peers, "cells": ratios(peers, [(128, 1), (128, 4), (128, 16), (128, 32)])}
    lines = llama_server_verdicts(result)
    assert len(lines) == 3  # concurrency 4 has no target
    assert "**1.50x** (target 1.5x: met)" in lines[0]
    assert "**2.40x** (target 2.5x: NOT met)" in lines[1]
    assert "completed none of its 32 requests" in lines[2] and "no ratio" in lines[2]


def test_gemma_section_holds_concurrency_16_to_twice_the_best_peer():
    from kvlab.report.serving_llama_server import gemma_section

    peers = [{"name": "kvlab", "status": "ran", "runs": [_run(1, 20.0, 1.0, 1.0), _run(16, 60.0, 1.0, 1.0)]},
             {"name": "llama-server", "status": "ran", "runs": [_run(1, 5.0, 1.0, 1.0), _run(16, 20.0, 1.0, 1.0)]},
             {"name": "vllm", "status": "ran", "runs": [_run(1, 7.0, 1.0, 1.0), _run(16, 31.0, 1.0, 1.0)]}]
    result = {"peers": peers, "cells": ratios(peers, [(128, 1), (128, 16)]), "provenance": PROV}
    page = "\n".join(gemma_section(result, []))
    assert "**1.94x** the best peer (vllm, 31.0 output tok/s); target 2x: NOT met" in page
    assert "Not measured yet" in "\n".join(gemma_section(None, []))


def test_gemma_bound_splits_each_step_and_holds_the_ceiling_against_the_best_peer():
    from kvlab.report.serving_llama_server import gemma_bound_lines

    bound = {"requests": 16, "input_len": 128, "output_len": 64, "repetitions": 5, "decode_position": 160,
             "weights": "gguf", "prefill_ms_per_token": {"1": 1.6, "16": 1.5},
             "decode_step_ms": {"1": 15.0, "16": 70.0}, "decode_layers_ms": {"1": 6.0, "16": 30.0},
             "greedy_pick_ms": {"1": 0.2, "16": 2.5}, "provenance": PROV}
    compare = {"cells": [{"max_concurrency": 16, "best_peer": {"name": "llama-server", "output_throughput": 75.0}}]}
    page = "\n".join(gemma_bound_lines(bound, compare))
    assert "| 16 | 70.0 | 30.0 | 40.0 | 2.5 |" in page  # the LM head is the step less its layers
    duration = 16 * 128 * 1.5 / 1e3 + 63 * 70.0 / 1e3  # 3.072 s of prefill, then 63 steps
    assert f"at least {duration:.2f} s" in page
    assert f"at most {1024 / duration:.1f} output tok/s, {1024 / duration / 75.0:.2f}x llama-server's 75.0" in page
    assert "Not measured yet" in "\n".join(gemma_bound_lines(None, compare))
