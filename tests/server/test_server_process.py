"""Server-level behaviour that needs its own process: the API key, 503 under overload, SIGTERM."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from needs import STORIES, require_file
from server_helpers import Served


@pytest.fixture(autouse=True)
def stories_present():
    require_file(STORIES, "../shared/models/stories260K.gguf")


def test_api_key_is_required_on_v1_routes_and_the_cache_reset():
    served = Served(str(STORIES), "--kv-cache-memory", "200000", "--api-key", "sekret")
    try:
        body = {"model": "test-model", "prompt": "Once", "max_tokens": 2}
        assert httpx.post(served.base + "/v1/completions", json=body).status_code == 401
        wrong = httpx.post(served.base + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
        ok = httpx.post(served.base + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(served.base + "/health").status_code == 200  # health needs no key
        assert httpx.post(served.base + "/reset_prefix_cache").status_code == 401  # it changes the server's state
        reset = httpx.post(served.base + "/reset_prefix_cache", headers={"Authorization": "Bearer sekret"})
        assert reset.status_code == 200 and set(reset.json()) == {"reset_blocks"}
    finally:
        assert served.stop() == 0


def test_overload_is_a_quick_503_and_sigterm_exits_0_mid_generation():
    """SmolLM2, not stories260K: on a fast machine stories260K finishes 400 tokens before the next
    request is sent, and the queue this test needs (one running, one waiting) never forms."""
    from needs import require_smollm2

    require_smollm2()
    served = Served("smollm2-135m", "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--max-num-seqs", "1",
                    "--max-waiting-requests", "1")
    codes: list[int] = []
    body = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}

    def ask() -> None:
        try:
            codes.append(httpx.post(served.base + "/v1/completions", json=body, timeout=60).status_code)
        except httpx.HTTPError:
            codes.append(-1)  # the server went away mid-request (SIGTERM below)

    def queued(running: int, waiting: int) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            m = served.metrics()
            if m["num_requests_running"] == running and m["num_requests_waiting"] == waiting:
                return
            time.sleep(0.02)
        raise AssertionError(f"never {running} running and {waiting} waiting: {served.metrics()}")

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for i, t in enumerate(threads):
        t.start()
        queued(1, i)  # one runs, then one waits
    started = time.monotonic()
    third = httpx.post(served.base + "/v1/completions", json=body, timeout=60)
    assert third.status_code == 503 and time.monotonic() - started < 5
    assert third.json()["error"]["type"] == "ServiceUnavailableError"
    assert served.stop(signal.SIGTERM) == 0  # aborts the running and waiting requests
    for t in threads:
        t.join(30)
    assert len(codes) == 2


def test_smollm2_chat_answers_the_openai_client():
    """The README's example: SmolLM2's chat template, through /v1/chat/completions, streamed and not."""
    from needs import require_module, require_smollm2

    openai = require_module("openai")
    require_smollm2()
    served = Served("smollm2-135m", "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    try:
        client = openai.OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = client.chat.completions.create(model="test-model", messages=messages, max_tokens=12, temperature=0)
        assert "Paris" in out.choices[0].message.content and out.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(model="test-model", messages=messages, max_tokens=12,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
        assert served.wait_idle()["kv_cache_usage_perc"] == 0
    finally:
        assert served.stop() == 0


def test_speculative_serving_reports_vllm_spec_metrics():
    served = Served(str(STORIES), "--kv-cache-memory", "2000000", "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        body = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 100, "temperature": 0}
        assert httpx.post(served.base + "/v1/completions", json=body, timeout=60).status_code == 200
        m = served.wait_idle()  # stories260K repeats itself within 100 tokens: prompt lookup finds it (6 of 89)
        assert m["spec_decode_num_drafts_total"] > 0
        assert 0 < m["spec_decode_num_accepted_tokens_total"] <= m["spec_decode_num_draft_tokens_total"]
    finally:
        assert served.stop() == 0


def test_bad_speculative_config_is_a_one_line_error():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "kvlab.cli", "serve", str(STORIES), "--speculative-config",
                           '{"method": "tree"}'], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "speculative method must be one of" in done.stderr
    assert "Traceback" not in done.stderr
