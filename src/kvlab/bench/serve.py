"""`kvlab bench serve`: load an OpenAI-compatible server and measure it as `vllm bench serve` does.

One run sends the same prompts at each `--max-concurrency` level in turn: arrivals follow
`--request-rate` (Poisson, or gamma with `--burstiness`), at most that many requests are in
flight (a semaphore, as vLLM), and every request streams so each token is timed. Before the
first level one probe request checks the endpoint and whether it takes vLLM's extra fields
(stream_options, ignore_eos); a server that refuses them (400/422) is benchmarked without,
and the result says so. Everything is bounded: `num_prompts` requests per level, each within
`request_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import httpx

from kvlab.bench.serve_client import RequestOutput, arrival_offsets, build_payload, send
from kvlab.bench.serve_data import BenchError, SampleRequest
from kvlab.bench.serve_metrics import calculate_metrics


@dataclass
class ServeBenchConfig:
    """What to send and how; the command line fills it (see `kvlab bench serve --help`)."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: Optional[str] = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    vllm_extras: Optional[bool] = None  # None: probe once; False: never send them
    sampling: dict = field(default_factory=dict)
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el")
    percentiles: Sequence[float] = (90.0, 99.0)
    goodput: Optional[dict[str, float]] = None
    request_timeout: float = 300.0
    disconnect_fraction: float = 0.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def server_models(config: ServeBenchConfig) -> list[dict]:
    """GET /v1/models: checks the URL, the key and the model name before any load is sent."""
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        reply = httpx.get(url, headers=config.headers, timeout=10)
    except httpx.HTTPError as error:
        raise BenchError(f"cannot reach {url}: {type(error).__name__}: {error}") from None
    if reply.status_code == 401:
        raise BenchError(f"{url} answered 401: give the server's key with --api-key")
    if reply.status_code != 200:
        raise BenchError(f"{url} answered {reply.status_code}; is {config.base_url} an OpenAI-compatible server?")
    try:
        return list(reply.json()["data"])
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url} did not return an OpenAI model list") from None


def with_disconnects(requests: list[SampleRequest], fraction: float, seed: int) -> list[SampleRequest]:
    """Mark `fraction` of the requests to hang up after a few chunks (a client leaving mid-stream)."""
    if fraction <= 0:
        return requests
    rng = random.Random(seed + 1)
    chosen = set(rng.sample(range(len(requests)), round(fraction * len(requests))))
    return [dataclasses.replace(r, disconnect_after=1 + rng.randrange(max(1, r.expected_output_len // 2)))
            if i in chosen and r.expected_output_len > 1 else r for i, r in enumerate(requests)]


def _client(limit: Optional[int], timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10.0, pool=None))


async def probe(config: ServeBenchConfig, request: SampleRequest) -> tuple[bool, RequestOutput]:
    """One request with vLLM's extras (unless told not to); on a 400/422, one without. Returns (extras, output)."""
    extras = config.vllm_extras is not False
    async with _client(2, config.request_timeout) as client:
        body = build_payload(config.endpoint, config.model, request.prompt, request.expected_output_len, extras,
                             config.ignore_eos, config.sampling)
        out = await send(client, config.url, body, config.headers, request.prompt_len, config.request_timeout)
        if extras and config.vllm_extras is None and out.status in (400, 422):
            extras = False
            body = build_payload(config.endpoint, config.model, request.prompt, request.expected_output_len, False,
                                 config.ignore_eos, config.sampling)
            out = await send(client, config.url, body, config.headers, request.prompt_len, config.request_timeout)
    if not out.success:
        raise BenchError(f"the probe request failed ({out.error}); check --endpoint, --model and the server log")
    return extras, out


async def run_level(config: ServeBenchConfig, requests: Sequence[SampleRequest], max_concurrency: Optional[int],
                    extras: bool, on_done: Optional[Callable[[], None]] = None) -> tuple[list[RequestOutput], float]:
    """Every request once, at most `max_concurrency` in flight (None: no cap); (outputs in order, wall seconds)."""
    gate = asyncio.Semaphore(max_concurrency or len(requests))
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)

    async def one(client: httpx.AsyncClient, request: SampleRequest) -> RequestOutput:
        async with gate:
            body = build_payload(config.endpoint, config.model, request.prompt, request.expected_output_len, extras,
                                 config.ignore_eos, config.sampling)
            out = await send(client, config.url, body, config.headers, request.prompt_len, config.request_timeout,
                             request.disconnect_after)
        if on_done is not None:
            on_done()
        return out

    async with _client(max_concurrency, config.request_timeout) as client:
        started = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets):
            wait = started + offset - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(client, request)))
        outputs = await asyncio.gather(*tasks)
        return list(outputs), time.perf_counter() - started


def level_result(config: ServeBenchConfig, outputs: list[RequestOutput], duration: float,
                 max_concurrency: Optional[int], tokenizer, detailed: bool = False) -> dict:
    """One level's JSON: vLLM's --save-result fields (traffic, then metrics), plus kvlab's counts."""
    result = {"request_rate": "inf" if config.request_rate == float("inf") else config.request_rate,
              "burstiness": config.burstiness, "max_concurrency": max_concurrency}
    result.update(calculate_metrics(outputs, duration, tokenizer, config.percentile_metrics, config.percentiles,
                                    config.goodput))
    failures = [o.error for o in outputs if not o.success and not o.cancelled]
    result["first_errors"] = failures[:10]
    if detailed:
        result.update({"input_lens": [o.prompt_len for o in outputs], "ttfts": [o.ttft for o in outputs],
                       "itls": [o.itl for o in outputs], "latencies": [o.latency for o in outputs],
                       "start_times": [o.start_time for o in outputs],
                       "generated_texts": [o.generated_text for o in outputs],
                       "errors": [o.error for o in outputs]})
    return result
