"""`kvlab serve` over real HTTP on loopback, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from needs import STORIES, require_file, require_module
from server_helpers import Served

openai = require_module("openai")


@pytest.fixture(scope="module")
def server():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    served = Served(str(STORIES), "--kv-cache-memory", "400000", "--block-size", "8", "--max-model-len", "256")
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def expected():
    """`kvlab generate`'s greedy text for the prompt, the reference every greedy answer must equal."""
    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.nn.generate import generate

    loaded = load_checkpoint(STORIES)
    ids = loaded.tokenizer.encode("Once upon a time")
    out = generate(loaded.model, ids, 24, stop_ids=[loaded.tokenizer.eos_id])[0].tolist()
    return loaded.tokenizer.decode(out), len(ids)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["test-model"]
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/version").json()["version"]


def test_completion_equals_kvlab_generate(client, expected):
    text, prompt_tokens = expected
    out = client.completions.create(model="test-model", prompt="Once upon a time", max_tokens=24, temperature=0)
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 24)


def test_streamed_completion_equals_the_whole_and_reports_usage(client, expected):
    text, prompt_tokens = expected
    chunks = list(client.completions.create(model="test-model", prompt="Once upon a time", max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_concurrent_requests_are_batched_and_each_equals_the_reference(server, client, expected):
    text, _ = expected
    results = [None] * 6
    start = server.metrics()

    def ask(i: int) -> None:
        results[i] = client.completions.create(model="test-model", prompt="Once upon a time", max_tokens=24,
                                               temperature=0).choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [text] * 6
    end = server.wait_idle()
    assert end["generation_tokens_total"] - start["generation_tokens_total"] == 6 * 24
    assert end["prompt_tokens_total"] - start["prompt_tokens_total"] == 6 * 5
    assert end["prefix_cache_queries_total"] - start["prefix_cache_queries_total"] == 6 * 5


def test_sampling_extras_stop_and_logprobs(client):
    out = client.completions.create(model="test-model", prompt="Once upon a time", max_tokens=40, temperature=0,
                                    stop=["Lily"], logprobs=2)
    assert out.choices[0].finish_reason == "stop" and "Lily" not in out.choices[0].text
    # the chosen token and the 2 likeliest (OpenAI's "up to logprobs + 1")
    assert all(2 <= len(top) <= 3 for top in out.choices[0].logprobs.top_logprobs)
    seeded = [client.completions.create(model="test-model", prompt="The cat", max_tokens=16, temperature=0.8,
                                        seed=3, extra_body={"top_k": 20, "min_p": 0.05}).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_vllm_bench_serves_completion_body_is_accepted(server):
    """The body vllm bench serve's openai backend sends (repetition_penalty 1.0, logprobs null, its extras)."""
    body = {"model": "test-model", "prompt": "Once upon a time", "repetition_penalty": 1.0, "max_tokens": 5,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 5


def test_reset_prefix_cache_makes_the_next_identical_prompt_a_miss(server, client):
    """Benchmarks (vLLM's and kvlab's) reset between runs, so a run is not served from the last one's prefixes."""
    prompt = "Once upon a time there was a little dog who liked to run in the big green park every day"

    def hits_of_one() -> float:
        before = server.wait_idle()["prefix_cache_hits_total"]
        client.completions.create(model="test-model", prompt=prompt, max_tokens=2, temperature=0)
        return server.wait_idle()["prefix_cache_hits_total"] - before

    hits_of_one()
    assert hits_of_one() > 0  # served from the first request's blocks
    reply = httpx.post(server.base + "/reset_prefix_cache", timeout=10)
    assert reply.status_code == 200 and reply.json()["reset_blocks"] > 0
    assert hits_of_one() == 0


def test_chat_without_a_template_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": 300}, "max_tokens"),  # prompt + max_tokens over --max-model-len 256
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "x", "no_such_field": 1}, "no_such_field"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_bodies_are_400_in_openai_shape(server, body, param):
    reply = httpx.post(server.base + "/v1/completions", json={"model": "test-model", **body})
    assert reply.status_code == 400
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert (err["param"] or "").startswith(param), err


def test_malformed_json_unknown_model(server):
    reply = httpx.post(server.base + "/v1/completions", content=b'{"model": "test-model", "prompt": ',
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == 400
    reply = httpx.post(server.base + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert reply.status_code == 404 and "gpt-9" in reply.json()["error"]["message"]


def test_a_client_leaving_mid_stream_frees_its_blocks(server):
    body = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        first = [json.loads(next(line for line in lines if line.startswith("data: "))[6:]) for _ in range(3)]
        assert all(chunk["choices"][0]["finish_reason"] is None for chunk in first)
    idle = server.wait_idle()  # the abort freed the request's blocks
    assert idle["kv_cache_usage_perc"] == 0
