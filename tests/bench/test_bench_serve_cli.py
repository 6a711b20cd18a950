"""`kvlab bench serve` against a real `kvlab serve stories260k` on loopback: the table, the JSON, the plot.

The server's own counters (/metrics) must agree with what the benchmark reports: every prompt
and generated token it claims was read or produced on the server, and nothing is left running.
"""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from needs import STORIES, require_file
from server_helpers import Served

VLLM_KEYS = {"date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "max_output_tokens_per_s", "max_concurrent_requests"} | {
             f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p90", "p99")
             for m in ("ttft", "tpot", "itl", "e2el")}


@pytest.fixture(scope="module")
def server():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    served = Served(str(STORIES), "--kv-cache-memory", "2MB", "--block-size", "8", "--max-model-len", "256",
                    name="stories")
    yield served
    assert served.stop() == 0


def test_a_sweep_writes_vllms_fields_and_agrees_with_the_servers_counters(server, tmp_path, capsys):
    before = server.metrics()
    out, png = tmp_path / "result.json", tmp_path / "plot.png"
    rc = main(["bench", "serve", "--base-url", server.base, "--model", "stories", "--tokenizer", str(STORIES),
               "--num-prompts", "8", "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5",
               "--max-concurrency", "1,4", "--goodput", "ttft:5000", "tpot:5000", "--result-file", str(out),
               "--plot", str(png), "--disable-tqdm"])
    printed = capsys.readouterr()
    assert rc == 0 and "Serving Benchmark Result" in printed.out and "concurrency 4" in printed.out
    assert "counted with" in printed.err and "extras (stream_options usage, ignore_eos): sent" in printed.err
    result = json.loads(out.read_text())
    assert [run["max_concurrency"] for run in result["runs"]] == [1, 4]
    assert result["provenance"]["git_commit"] and result["model_id"] == "stories"
    for run in result["runs"]:
        assert VLLM_KEYS <= set(run) | set(result)
        assert (run["completed"], run["failed"], run["cancelled"]) == (8, 0, 0)
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        assert run["output_tokens_counted_by"] == "server usage (8)"
    assert result["runs"][0]["total_input_tokens"] == result["runs"][1]["total_input_tokens"]
    assert png.stat().st_size > 10_000
    after = server.wait_idle()
    # the probe request plus both levels: the server generated exactly what the client counted (ignore_eos)
    sent_out = sum(run["total_output_tokens"] for run in result["runs"])
    sent_in = sum(run["total_input_tokens"] for run in result["runs"])
    grown_out = after["generation_tokens_total"] - before["generation_tokens_total"]
    grown_in = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert 0 < grown_out - sent_out <= 12 and 0 < grown_in - sent_in <= 40  # the difference is the probe
    assert after["num_requests_running"] == 0 and after["kv_cache_usage_perc"] == 0


def test_request_rate_and_prefix_repetition_single_level_is_flat_json(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", server.base, "--dataset-name", "prefix-repetition",
               "--prefix-len", "40", "--suffix-len", "4", "--num-prefixes", "2", "--output-len", "4",
               "--num-prompts", "6", "--request-rate", "30", "--burstiness", "0.5", "--result-file", str(out),
               "--tokenizer", str(STORIES), "--disable-tqdm"])
    capsys.readouterr()
    result = json.loads(out.read_text())
    assert rc == 0 and result["completed"] == 6 and result["request_rate"] == 30 and result["burstiness"] == 0.5
    assert result["model_id"] == "stories" and result["max_concurrency"] is None  # the server's first model


@pytest.mark.parametrize("argv,message", [
    (["--model", "nope"], "serves stories, not 'nope'"),
    (["--endpoint", "/v1/chat/completions"], "no chat template"),
    (["--goodput", "ttft=5"], "KEY:MS"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--percentile-metrics", "ttft,speed"], "unknown speed"),
    (["--input-len", "300", "--tokenizer", str(STORIES)], "exceeds the server's max_model_len 256"),
    (["--input-len", "300"], "the probe request failed (HTTP 400: this model's maximum context length is 256"),
    (["--tokenizer", "no-such-model"], "--tokenizer no-such-model"),
])
def test_mistakes_are_one_line_exit_2(server, capsys, argv, message):
    rc = main(["bench", "serve", "--base-url", server.base, "--num-prompts", "2", "--disable-tqdm", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and message in err[-1] and err[-1].startswith("kvlab bench: error:"), err


def test_an_unreachable_server_is_one_line(capsys):
    from server_helpers import free_port

    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--disable-tqdm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot reach" in err[0]
