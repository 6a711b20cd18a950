"""Whatever a client sends, `kvlab serve` answers: a clear 4xx or a valid answer, never a 5xx, a crash or a hang.

Hypothesis builds request bodies from the fields the routes know (with wrong types, huge,
negative and non-finite numbers, odd stop lists) plus unknown fields; fixed cases add empty
and 1 MB prompts, invalid UTF-8 and deeply nested JSON. Each request has a 60 s limit and the
server must still be healthy, with every block free, at the end.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from needs import STORIES, require_file
from server_helpers import Served

NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2**63, 2**64, 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-40, 1e308, -0.0]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=40))
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=12)
PROMPTS = st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 600), max_size=20),
                    st.lists(st.text(max_size=10), max_size=3), st.lists(st.lists(st.integers(0, 600), max_size=5),
                                                                        max_size=2), JSONISH)
STOPS = st.one_of(st.none(), st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5), JSONISH)
FIELDS = {
    "max_tokens": st.one_of(st.integers(-3, 300), NUMBERS, JSONISH), "temperature": st.one_of(NUMBERS, JSONISH),
    "top_p": NUMBERS, "top_k": st.one_of(st.integers(-3, 10**6), NUMBERS), "min_p": NUMBERS, "seed": NUMBERS,
    "stop": STOPS, "stop_token_ids": st.one_of(st.lists(NUMBERS, max_size=3), JSONISH), "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()}), JSONISH),
    "logprobs": st.one_of(st.integers(-2, 30), JSONISH), "ignore_eos": st.one_of(st.booleans(), JSONISH),
    "n": NUMBERS, "echo": st.booleans(), "best_of": NUMBERS, "presence_penalty": NUMBERS,
    "include_stop_str_in_output": JSONISH, "user": JSONISH, "no_such_field": JSONISH,
}
SEEN: Counter = Counter()  # status codes answered, so the fuzz is known to reach the model too
CHAT_FIELDS = {"messages": st.one_of(st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
     "content": st.one_of(st.text(max_size=30), JSONISH)}), max_size=3), JSONISH),
    "max_completion_tokens": NUMBERS, "top_logprobs": NUMBERS, "logprobs": JSONISH}


@pytest.fixture(scope="module")
def served():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    server = Served(str(STORIES), "--kv-cache-memory", "2MB", "--block-size", "8", "--max-model-len", "256")
    yield server
    server.wait_idle()
    assert server.stop() == 0


def post(served: Served, path: str, content: bytes) -> httpx.Response:
    """POST raw bytes, read the whole answer (streamed or not) within 60 s, and check it is not a server fault."""
    with httpx.stream("POST", served.base + path, content=content, headers={"content-type": "application/json"},
                      timeout=60) as reply:
        body = reply.read()
    SEEN[reply.status_code] += 1
    assert reply.status_code < 500, (reply.status_code, content[:300], body[:300])
    if reply.status_code == 200:
        if reply.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        else:
            assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        err = json.loads(body)["error"]
        assert err["code"] == reply.status_code and err["message"] and "Traceback" not in err["message"]
    return reply


def encode(body: dict) -> bytes:
    """JSON as Python writes it: NaN and Infinity as literals, which Python servers parse."""
    return json.dumps(body, allow_nan=True).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(prompt=PROMPTS, fields=st.fixed_dictionaries({}, optional=FIELDS), model=st.sampled_from(["test-model", 3]))
def test_completions_fuzz(served, prompt, fields, model):
    post(served, "/v1/completions", encode({"model": model, "prompt": prompt, **fields}))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(fields=st.fixed_dictionaries({}, optional={**FIELDS, **CHAT_FIELDS}))
def test_chat_fuzz(served, fields):
    post(served, "/v1/chat/completions", encode({"model": "test-model", **fields}))


ODD_BODIES = [
    b"", b"{", b"null", b"[]", b'"just a string"', b"\xff\xfe\x00garbage",
    b'{"model": "test-model", "prompt": "\xff\xfe invalid utf-8"}',
    b'{"model": "test-model", "prompt": "\\ud800 lone surrogate"}',
    b'{"model": "test-model", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model": "test-model", "prompt": "x", "user": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    encode({"model": "test-model", "prompt": ""}),
    encode({"model": "test-model", "prompt": "a b " * 262_144}),  # 1 MiB of text: refused as too long
    encode({"model": "test-model", "prompt": list(range(5)) * 200_000}),
    encode({"model": "test-model", "prompt": "x", "temperature": math.nan}),
    encode({"model": "test-model", "prompt": "x", "temperature": 1e-40, "max_tokens": 4}),
    encode({"model": "test-model", "prompt": "x", "seed": 2**64}),
    encode({"model": "test-model", "prompt": "x", "stop": ["", None]}),
    encode({"model": "test-model", "prompt": "x", "stop": ["a"] * 10_000, "max_tokens": 4}),
]


@pytest.mark.parametrize("content", ODD_BODIES, ids=[f"{i}:{c[:24]!r}:{len(c)}B" for i, c in enumerate(ODD_BODIES)])
def test_odd_bodies(served, content):
    post(served, "/v1/completions", content)


def test_still_healthy_and_empty_after_the_fuzz(served):
    assert httpx.get(served.base + "/health", timeout=10).status_code == 200
    assert served.proc.poll() is None
    assert served.wait_idle()["kv_cache_usage_perc"] == 0
    assert SEEN[200] >= 5 and SEEN[400] >= 20, SEEN  # answers and refusals both
