"""One streamed request, timed token by token, and the arrival schedule that sends them.

Timing follows vLLM's `benchmarks/lib/endpoint_request_func.py`: the clock starts as the
request is sent; TTFT is the first chunk that carries a choice; each later such chunk adds an
inter-token latency; the request's latency (E2EL) ends at the last token chunk, not at the
trailing usage chunk. One difference: a chat stream's opening chunk that holds only the role
(empty content, no finish reason) is not a token. vLLM's server sends it with the first
token, but a server that sends it at once (kvlab's did) would otherwise show a TTFT of ~0.
A request succeeds when it streamed at least one token and ended cleanly. A request the client itself abandons (`disconnect_after`) is `cancelled`, neither
completed nor failed; every other outcome is counted, with its HTTP status and error.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import numpy as np


@dataclass
class RequestOutput:
    """What the client saw of one request (vLLM's RequestFuncOutput, plus status and cancelled)."""

    prompt_len: int = 0
    generated_text: str = ""
    success: bool = False
    cancelled: bool = False
    status: Optional[int] = None  # HTTP status; an error event inside a 200 stream sets its own code
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: Optional[int] = None  # from the server's usage, when it sent one
    chunks: int = 0
    start_time: float = 0.0
    error: str = ""


def build_payload(endpoint: str, model: str, prompt: str, max_tokens: int, extras: bool, ignore_eos: bool,
                  sampling: dict) -> dict:
    """The OpenAI body; `extras` adds what only vLLM-like servers take (usage in the stream, ignore_eos)."""
    body: dict = {"model": model, "stream": True, **sampling}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if extras:
        body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            body["ignore_eos"] = True
    return body


def _error_text(raw: bytes, status: int) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}"


async def send(client: httpx.AsyncClient, url: str, body: dict, headers: dict, prompt_len: Optional[int],
               timeout_s: float, disconnect_after: Optional[int] = None) -> RequestOutput:
    """POST one streamed request and time its chunks; never raises (failures are in the output)."""
    out = RequestOutput(prompt_len=prompt_len or 0)
    try:
        await asyncio.wait_for(_stream(client, url, body, headers, out, disconnect_after), timeout_s)
    except asyncio.TimeoutError:
        out.success, out.error = False, f"no answer within --request-timeout {timeout_s:g} s"
    except (httpx.HTTPError, ValueError) as error:  # connection trouble, or a chunk that is not JSON
        out.success, out.error = False, f"{type(error).__name__}: {error}"
    return out


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, out: RequestOutput,
                  disconnect_after: Optional[int]) -> None:
    out.start_time = started = last = time.perf_counter()
    chat = "messages" in body
    async with client.stream("POST", url, json=body, headers=headers) as reply:
        out.status = reply.status_code
        if reply.status_code != 200:
            out.error = _error_text(await reply.aread(), reply.status_code)
            return
        async for line in reply.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:  # an error event inside the stream (the model failed mid-way)
                err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                out.status = err.get("code") if isinstance(err.get("code"), int) else 500
                out.error = f"stream error {out.status}: {err.get('message')}"
                return
            choice = (chunk.get("choices") or [None])[0]
            piece = None
            if isinstance(choice, dict):
                delta = choice.get("delta") or {}
                piece = delta.get("content") if chat else choice.get("text")
                if chat and "role" in delta and not piece and choice.get("finish_reason") is None:
                    continue  # the role-only opening chunk carries no token
            if choice is not None:
                now = time.perf_counter()
                if out.chunks == 0:
                    out.ttft = now - started
                else:
                    out.itl.append(now - last)
                last = now
                out.generated_text += piece or ""
                out.chunks += 1
                if disconnect_after is not None and out.chunks >= disconnect_after:
                    out.cancelled, out.latency = True, last - started
                    return  # leaving the `async with` closes the connection mid-stream
            elif isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
                out.output_tokens = usage.get("completion_tokens")
                if isinstance(usage.get("prompt_tokens"), int):
                    out.prompt_len = usage["prompt_tokens"]
    out.latency = last - started
    out.success = out.chunks > 0
    if not out.success:
        out.error = "the stream ended before any token"


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent, as vLLM's get_request.

    inf: all at once. Otherwise gaps are gamma-distributed with shape `burstiness` and mean
    1/rate (burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular, inf
    constant), then rescaled so the last request goes at exactly num/rate, as vLLM does.
    """
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        gaps = np.full(num, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (num / request_rate) / times[-1]
    return times.tolist()
