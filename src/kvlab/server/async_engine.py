"""The engine on a thread of its own, feeding each HTTP request's asyncio queue with its deltas.

The engine is synchronous and steps as fast as the model allows; the server is asyncio. One
background thread owns the engine: it takes new requests and aborts under a lock between
steps, steps, and hands each delta to the event loop that waits for it
(`call_soon_threadsafe`). Requests therefore join and leave the batch between steps, never
during one. When there is nothing to do the thread sleeps until woken (a new request) or
until the scheduler's max-wait deadline.

With `stream_interval` N > 1 (vLLM's `--stream-interval`), a request's deltas are held and sent
N tokens at a time: its first token at once (TTFT is unchanged), then whenever N tokens are
waiting, and whatever is left when it finishes. Each delta sent costs the event loop a queue
hand-off, an SSE chunk and a socket write; on a small CPU those run on the cores the model's
step needs, so at many streams fewer, larger chunks leave the step more of the machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Sequence, Union

import torch

from kvlab.engine.engine import LLMEngine
from kvlab.engine.errors import EngineOverloaded, RequestError
from kvlab.engine.outputs import StepDelta
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.sequence import Sequence as Seq

log = logging.getLogger("kvlab.server")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stream_interval = stream_interval
        self.held: dict[str, StepDelta] = {}  # per request, the tokens not sent yet (stream_interval > 1)
        self.started: set[str] = set()  # requests whose first token has been sent
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="kvlab-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, prompt: Union[str, Sequence[int]], params: SamplingParams, request_id: str
               ) -> tuple[Seq, asyncio.Queue]:
        """Queue a request; its deltas arrive on the returned queue. Raises RequestError / EngineOverloaded."""
        seqs, queue = self.submit_many([prompt], params, request_id)
        return seqs[0], queue

    def submit_many(self, prompts: list[Union[str, Sequence[int]]], params: SamplingParams, request_id: str
                    ) -> tuple[list[Seq], asyncio.Queue]:
        """Queue `params.n` samples of each prompt (a request's choices, in OpenAI's order: prompt by
        prompt, sample by sample); every sequence's deltas arrive on the one returned queue, tagged by
        its request id. All or none are queued: a prompt refused refuses the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        count = len(prompts) * params.n
        if count > self.max_waiting_requests:
            raise RequestError(f"this request makes {count} sequences ({len(prompts)} prompts x n={params.n}); "
                               f"at most {self.max_waiting_requests} (--max-waiting-requests) can wait", "prompt")
        seqs: list[Seq] = []
        with self.lock:
            if self.stopping:
                raise EngineOverloaded("the server is shutting down")
            if self.engine.num_waiting >= self.max_waiting_requests:
                raise EngineOverloaded(f"{self.engine.num_waiting} requests are waiting already "
                                       f"(--max-waiting-requests {self.max_waiting_requests}); retry later")
            try:
                for i, prompt in enumerate(prompts):
                    rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                    own = params if len(prompts) == 1 else dataclasses.replace(params)  # max_tokens None: per prompt
                    seqs += self.engine.add_samples(prompt, own, rid) if params.n > 1 else \
                        [self.engine.add_request(prompt, own, rid)]
            except Exception:  # no step ran in between (the lock): the others never started
                for seq in seqs:
                    self.engine.abort(seq.request_id)
                raise
            for seq in seqs:
                self.streams[seq.request_id] = (loop, queue)
        self.wake.set()
        return seqs, queue

    def abort(self, request_id: str) -> None:
        """The client is gone (or the server stops): free the request's blocks now."""
        with self.lock:
            self.engine.abort(request_id)
            self.streams.pop(request_id, None)
            self.held.pop(request_id, None)
            self.started.discard(request_id)

    def reset_prefix_cache(self) -> int:
        """Between steps, as every change to the engine: see LLMEngine.reset_prefix_cache."""
        with self.lock:
            return self.engine.reset_prefix_cache()

    def abort_all(self) -> None:
        with self.lock:
            self.stopping = True
            for request_id, (loop, queue) in list(self.streams.items()):
                self.engine.abort(request_id)
                loop.call_soon_threadsafe(queue.put_nowait, StepDelta(request_id, finished=True,
                                                                      finish_reason="abort"))
            self.streams.clear()
            self.held.clear()
            self.started.clear()
        self.wake.set()

    def stop(self) -> None:
        self.abort_all()
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    def _coalesce(self, deltas: list[StepDelta]) -> list[StepDelta]:
        """The deltas to send now under stream_interval (module doc); the rest are held, merged per request."""
        ready = []
        for d in deltas:
            held = self.held.pop(d.request_id, None)
            if held is not None:
                d = StepDelta(d.request_id, held.token_ids + d.token_ids, held.text + d.text,
                              held.logprobs + d.logprobs, d.finished, d.finish_reason, d.error)
            first = d.request_id not in self.started
            if d.finished or first or len(d.token_ids) >= self.stream_interval:
                ready.append(d)
                if d.finished:
                    self.started.discard(d.request_id)
                elif d.token_ids:
                    self.started.add(d.request_id)
            else:
                self.held[d.request_id] = d
        return ready

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.lock:
                if self.stopping and not self.engine.has_unfinished():
                    return
                busy = self.engine.has_unfinished()
                deltas = self.engine.step() if busy else []
                if self.stream_interval > 1:
                    deltas = self._coalesce(deltas)
                deliveries = [(self.streams.get(d.request_id), d) for d in deltas]
                for d in deltas:
                    if d.finished:
                        self.streams.pop(d.request_id, None)
                running = self.engine.num_running
                deadline = self.engine.scheduler.next_deadline()
            for target, delta in deliveries:
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, delta)
            if not busy:
                self.wake.wait(timeout=1.0)
                self.wake.clear()
            elif not deltas and not running:  # held by the max-wait rule: sleep until it admits
                pause = 0.001 if deadline is None else max(0.0, deadline - time.monotonic())
                self.wake.wait(timeout=min(pause, 0.05))
                self.wake.clear()
