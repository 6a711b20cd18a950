"""`kvlab bench serve`'s parts: vLLM's metric definitions, arrivals, datasets, and the client's timing.

The client is timed against a fake loopback server whose chunk gaps are known, so TTFT, ITL
and TPOT can be checked as numbers, not just as keys.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from fake_server import FakeServer
from kvlab.bench.serve import ServeBenchConfig, probe, run_level, with_disconnects
from kvlab.bench.serve_client import RequestOutput, arrival_offsets
from kvlab.bench.serve_data import (BenchError, SampleRequest, prefix_repetition_requests, random_requests,
                                    sharegpt_requests)
from kvlab.bench.serve_metrics import calculate_metrics
from needs import STORIES, require_file


@pytest.fixture(scope="module")
def tokenizer():
    from kvlab.bench.serve_data import load_tokenizer

    require_file(STORIES, "../shared/models/stories260K.gguf")
    return load_tokenizer(str(STORIES))


def done(ttft: float, itl: list[float], tokens: int, prompt: int = 10, start: float = 0.0) -> RequestOutput:
    return RequestOutput(prompt_len=prompt, success=True, status=200, ttft=ttft, itl=itl,
                         latency=ttft + sum(itl), output_tokens=tokens, chunks=len(itl) + 1, start_time=start)


def test_metrics_follow_vllms_definitions():
    outputs = [done(0.1, [0.02, 0.02, 0.02], 4), done(0.3, [0.05], 2, start=0.5), done(0.2, [], 1),
               RequestOutput(status=500, error="HTTP 500: boom"), RequestOutput(cancelled=True, status=200)]
    m = calculate_metrics(outputs, 2.0, None, ("ttft", "tpot", "itl", "e2el"), (50, 99.9), {"ttft": 250, "tpot": 30})
    assert (m["completed"], m["failed"], m["cancelled"]) == (3, 1, 1)
    assert m["status_counts"] == {"200": 3, "500": 1}
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 7)
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 3.5 and m["total_token_throughput"] == 18.5
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 300, 200]))
    # TPOT = (E2EL - TTFT) / (tokens - 1), only over requests with two tokens or more
    assert m["mean_tpot_ms"] == pytest.approx((20 + 50) / 2)
    assert m["mean_itl_ms"] == pytest.approx((20 * 3 + 50) / 4)  # pooled over every gap
    assert m["mean_e2el_ms"] == pytest.approx((160 + 350 + 200) / 3)
    assert "p50_ttft_ms" in m and "p99.9_e2el_ms" in m
    # goodput: ttft <= 250 ms and tpot <= 30 ms: the first (100, 20) and the one-token request (200, 0)
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert m["max_concurrent_requests"] == 2
    assert m["output_tokens_counted_by"] == "server usage (3)"


def test_all_failed_is_zeros_not_a_crash():
    m = calculate_metrics([RequestOutput(status=503)], 1.0, None, ("ttft",), (99,), None)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0 and m["request_goodput"] is None


def test_arrivals_poisson_gamma_and_all_at_once():
    assert arrival_offsets(5, float("inf"), 1.0, 0) == [0.0] * 5
    t = np.array(arrival_offsets(4000, 20.0, 1.0, 0))
    gaps = np.diff(t)
    assert t[-1] == pytest.approx(4000 / 20.0)  # rescaled as vLLM does: the last goes at N / rate
    assert gaps.mean() == pytest.approx(0.05, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)
    bursty = np.diff(arrival_offsets(4000, 20.0, 0.25, 0))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.25)  # gamma: CV = 1 / sqrt(shape)
    regular = np.diff(arrival_offsets(50, 20.0, float("inf"), 0))
    assert np.allclose(regular, 0.05)
    assert arrival_offsets(10, 5.0, 1.0, 3) == arrival_offsets(10, 5.0, 1.0, 3)


def test_random_dataset_lengths_prefix_and_seed(tokenizer):
    reqs = random_requests(50, 20, 10, 0.5, 8, 1, tokenizer)
    assert all(18 <= r.prompt_len <= 38 and 5 <= r.expected_output_len <= 15 for r in reqs)
    assert all(len(tokenizer.encode(r.prompt, add_bos=False)) == r.prompt_len for r in reqs)  # exact, re-encoded
    head = tokenizer.encode(reqs[0].prompt, add_bos=False)[:8]
    assert all(tokenizer.encode(r.prompt, add_bos=False)[:8] == head for r in reqs)  # the shared prefix
    assert [r.prompt for r in random_requests(50, 20, 10, 0.5, 8, 1, tokenizer)] == [r.prompt for r in reqs]
    words = random_requests(3, 12, 4, 0.0, 0, 0, None)
    assert all(len(r.prompt.split()) == 12 and r.prompt_len is None for r in words)
    with pytest.raises(BenchError, match="range-ratio"):
        random_requests(3, 12, 4, 1.0, 0, 0, None)


def test_prefix_repetition(tokenizer):
    reqs = prefix_repetition_requests(12, 30, 5, 3, 8, 0, tokenizer)
    heads = {tuple(tokenizer.encode(r.prompt, add_bos=False)[:25]) for r in reqs}
    assert len(reqs) == 12 and len(heads) == 3 and all(r.expected_output_len == 8 for r in reqs)
    with pytest.raises(BenchError, match="at least --num-prefixes"):
        prefix_repetition_requests(2, 30, 5, 3, 8, 0, None)


def test_sharegpt_file_of_the_real_shape(tmp_path, tokenizer):
    def conv(q: str, a: str) -> dict:
        return {"id": q[:3], "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    data = [conv("Once upon a time there was a dog", "The dog ran to the park and played all day long."),
            conv("Tell me a story about a cat", "A cat sat on a mat. It was happy."),
            {"id": "one-turn", "conversations": [{"from": "human", "value": "alone"}]},
            conv("hi", "too short a prompt to keep"), {"no": "conversations"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), 5, 0, None, tokenizer, max_model_len=512)
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {data[0]["conversations"][0]["value"],
                                                           data[1]["conversations"][0]["value"]}
    answer = data[1]["conversations"][1]["value"]
    assert any(r.expected_output_len == len(tokenizer.encode(answer, add_bos=False)) for r in reqs)
    assert all(r.expected_output_len == 7 for r in sharegpt_requests(str(path), 3, 0, 7, None))
    with pytest.raises(BenchError, match="needs --output-len"):
        sharegpt_requests(str(path), 3, 0, None, None)
    path.write_text("{not json")
    with pytest.raises(BenchError, match="not JSON"):
        sharegpt_requests(str(path), 3, 0, 7, None)
    cut = json.dumps(data)
    path.write_text(cut[:cut.index("Tell me a story")])  # cut off inside an entry, as the wheel's copy is
    assert {r.prompt for r in sharegpt_requests(str(path), 4, 0, 7, None)} == {data[0]["conversations"][0]["value"]}
    path.write_text("[{not json")
    with pytest.raises(BenchError, match="not JSON"):
        sharegpt_requests(str(path), 3, 0, 7, None)


def test_client_times_chunks_and_counts_usage():
    with FakeServer(ttft_s=0.08, gap_s=0.03) as fake:
        config = ServeBenchConfig(fake.base, "fake", percentiles=(50,))
        reqs = [SampleRequest("hello", 5, 6) for _ in range(4)]
        extras, _ = asyncio.run(probe(config, reqs[0]))
        outputs, duration = asyncio.run(run_level(config, reqs, 2, extras))
    assert extras and all(o.success and o.output_tokens == 6 and o.prompt_len == 7 for o in outputs)
    m = calculate_metrics(outputs, duration, None, ("ttft", "itl", "tpot"), (50,))
    assert 75 <= m["median_ttft_ms"] <= 250 and 25 <= m["median_itl_ms"] <= 120 and 25 <= m["mean_tpot_ms"] <= 120
    assert m["max_concurrent_requests"] == 2 and duration >= 2 * (0.08 + 5 * 0.03)
    assert fake.bodies[-1]["stream_options"] == {"include_usage": True}


def test_a_server_refusing_vllm_extras_is_benchmarked_without_them():
    with FakeServer(ttft_s=0.0, gap_s=0.0, strict=True) as fake:
        config = ServeBenchConfig(fake.base, "fake", ignore_eos=True)
        extras, _ = asyncio.run(probe(config, SampleRequest("hello", None, 3)))
        outputs, _ = asyncio.run(run_level(config, [SampleRequest("x", None, 3)] * 3, None, extras))
    assert not extras and all(o.success and o.output_tokens is None and o.chunks == 3 for o in outputs)
    assert calculate_metrics(outputs, 1.0, None, (), ())["output_tokens_counted_by"] == "stream chunks (3)"
    assert "ignore_eos" not in fake.bodies[-1] and "stream_options" not in fake.bodies[-1]


def test_failures_and_hang_ups_are_counted_never_dropped():
    with FakeServer(ttft_s=0.0, gap_s=0.01) as fake:
        config = ServeBenchConfig(fake.base, "fake", endpoint="/v1/chat/completions")
        reqs = with_disconnects([SampleRequest("fine", None, 8) for _ in range(10)], 0.3, 0)
        reqs += [SampleRequest("FAIL please", None, 4)]
        outputs, duration = asyncio.run(run_level(config, reqs, 4, True))
    m = calculate_metrics(outputs, duration, None, ("e2el",), (99,))
    assert (m["completed"], m["cancelled"], m["failed"]) == (7, 3, 1)
    assert m["status_counts"] == {"200": 7, "500": 1}
    assert any("HTTP 500: boom" in o.error for o in outputs)
    assert sum(r.disconnect_after is not None for r in reqs) == 3


def test_a_chat_streams_role_only_opening_chunk_is_not_the_first_token():
    with FakeServer(ttft_s=0.15, gap_s=0.01) as fake:
        config = ServeBenchConfig(fake.base, "fake", endpoint="/v1/chat/completions")
        outputs, _ = asyncio.run(run_level(config, [SampleRequest("hi", None, 3)], None, True))
    assert outputs[0].success and outputs[0].ttft >= 0.15 and outputs[0].chunks == 3
    assert outputs[0].generated_text == " w w w"
