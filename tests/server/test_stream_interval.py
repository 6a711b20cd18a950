"""`--stream-interval N`: a request's tokens go out N at a time, the first at once, nothing lost or reordered."""

from __future__ import annotations

import json

import httpx
import pytest

from needs import STORIES, require_file
from server_helpers import Served


def _engine(interval: int):
    from kvlab.server.async_engine import AsyncEngine

    class Idle:  # the coalescing never touches the engine
        def abort(self, request_id):
            pass
    return AsyncEngine(Idle(), stream_interval=interval)


def _delta(request_id, token, finished=False):
    from kvlab.engine.outputs import StepDelta

    return StepDelta(request_id, [token], f"<{token}>", [], finished, "length" if finished else None)


def test_the_first_token_goes_at_once_then_n_at_a_time_and_the_rest_at_the_end():
    engine = _engine(3)
    sent = [engine._coalesce([_delta("a", t, finished=t == 6), _delta("b", 10 + t)]) for t in range(1, 7)]
    a = [d for step in sent for d in step if d.request_id == "a"]
    assert [d.token_ids for d in a] == [[1], [2, 3, 4], [5, 6]]  # first at once, then 3, then what is left
    assert [d.text for d in a] == ["<1>", "<2><3><4>", "<5><6>"] and a[-1].finished and a[-1].finish_reason == "length"
    assert [len(step) for step in sent] == [2, 0, 0, 2, 0, 1]  # b: its first, then its 2..4; 5..6 still held
    assert [d.token_ids for d in sent[3] if d.request_id == "b"] == [[12, 13, 14]]
    assert set(engine.held) == {"b"} and engine.started == {"b"}  # a finished: nothing of it is kept
    engine.abort("b")  # the client left: its held tokens go with it
    assert engine.held == {} and engine.started == set()


def test_an_interval_of_one_or_less():
    assert _engine(1)._coalesce([_delta("a", 1)])[0].token_ids == [1]
    with pytest.raises(ValueError, match="stream_interval must be at least 1"):
        _engine(0)


def test_a_served_stream_in_fours_carries_the_same_text_and_usage():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    plain = Served(str(STORIES), "--kv-cache-memory", "400000")
    coalesced = Served(str(STORIES), "--kv-cache-memory", "400000", "--stream-interval", "4")
    try:
        body = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        texts, usages, counts = [], [], []
        for served in (plain, coalesced):
            with httpx.stream("POST", served.base + "/v1/completions", json=body, timeout=60) as response:
                events = [json.loads(line[6:]) for line in response.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            pieces = [e["choices"][0]["text"] for e in events if e["choices"]]
            texts.append("".join(pieces))
            counts.append(len(pieces))
            usages.append(events[-1]["usage"]["completion_tokens"])
        assert texts[0] == texts[1] and usages == [10, 10]
        assert counts == [10, 4]  # 1 + 4 + 4 + the last 1
    finally:
        assert plain.stop() == 0 and coalesced.stop() == 0
