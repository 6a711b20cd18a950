"""One completion or chat request from submission to its response: whole, or streamed as server-sent events.

A request is one or more prompts times n samples: sequences in the engine, each a choice
(index = prompt x n + sample, OpenAI's order), all feeding one queue. The response waits for
every choice (or streams each choice's deltas as they come, tagged with its index); a client
that leaves aborts all of them. Echo puts the prompt's text (and, with logprobs, its
log-probabilities) before the choice's own; max_tokens 0 with echo returns the prompt alone.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvlab.server.choices import Pieces, chat_logprobs, completion_logprobs, prompt_logprobs, usage


@dataclass
class Ask:
    """What the response must hold, besides each choice's text."""

    chat: bool
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the generated token is dropped
    logprobs: bool = False
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in each choice
    prompt_texts: list[str] = field(default_factory=list)
    tool_body: object = None  # a chat body whose output is tool calls (ChatCompletionRequest)


@dataclass
class Choice:
    index: int
    seq: object
    prompt_index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list = field(default_factory=list)
    reason: Optional[str] = None
    error: Optional[str] = None
    done: bool = False
    opened: bool = False  # its first chunk went out (streaming)


class Responder:
    def __init__(self, async_engine, served_model_name: str, error) -> None:
        self.async_engine, self.name, self.error = async_engine, served_model_name, error
        self.piece = Pieces(async_engine.engine.tokenizer)

    async def respond(self, request: Request, ask: Ask, prompts: list, params):
        request_id = f"{'chatcmpl' if ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        seqs, queue = self.async_engine.submit_many(prompts, params, request_id)
        per_prompt = len(seqs) // len(prompts)
        choices = {seq.request_id: Choice(i, seq, i // per_prompt) for i, seq in enumerate(seqs)}
        firsts = [seqs[p * per_prompt] for p in range(len(prompts))]  # hold prompt_logprobs for their prompt
        created = int(time.time())
        if ask.stream:
            return StreamingResponse(self._stream(request_id, choices, firsts, queue, created, ask),
                                     media_type="text/event-stream")
        try:
            while not all(c.done for c in choices.values()):
                delta = await queue.get()
                c = choices[delta.request_id]
                c.text.append(delta.text)
                c.tokens += len(delta.token_ids)
                c.logprobs += delta.logprobs
                if delta.finished:
                    c.done, c.reason, c.error = True, delta.finish_reason, delta.error
        finally:
            for c in choices.values():
                if not c.done:  # the client went away while we waited
                    self.async_engine.abort(c.seq.request_id)
        failed = next((c.error for c in choices.values() if c.error), None)
        if failed:
            return self.error(f"the model failed on this request: {failed}", "InternalServerError", 500)
        out = [self._choice(c, firsts[c.prompt_index], ask) for c in sorted(choices.values(), key=lambda c: c.index)]
        completion = 0 if ask.echo_only else sum(c.tokens for c in choices.values())
        response = {"id": request_id, "object": "chat.completion" if ask.chat else "text_completion",
                    "created": created, "model": self.name, "choices": out,
                    "usage": usage(sum(len(s.prompt_ids) for s in firsts), completion)}
        if ask.chat and ask.prompt_logprobs:  # vLLM puts a chat prompt's at the top, a completion's in each choice
            response["prompt_logprobs"] = prompt_logprobs(self._prompt_entries(firsts[0]), self.piece)
        return response

    def _choice(self, c: Choice, first, ask: Ask) -> dict:
        text = "".join(c.text)
        choice: dict = {"index": c.index, "finish_reason": c.reason}
        if ask.chat:
            choice["logprobs"] = chat_logprobs(c.logprobs, self.piece) if ask.logprobs else None
            if ask.tool_body is not None:
                calls = ask.tool_body.tool_calls(text)
                choice["message"] = {"role": "assistant", "content": None if calls else text, "tool_calls": calls}
                if calls and ask.tool_body.tool_mode() == "required":
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            token_ids, entries = self._echoed(c, first, ask)
            choice["text"] = self._echo_text(c, ask) + ("" if ask.echo_only else text)
            choice["logprobs"] = completion_logprobs(token_ids, entries, self.piece) if ask.logprobs else None
        if ask.prompt_logprobs and not ask.chat:
            choice["prompt_logprobs"] = prompt_logprobs(self._prompt_entries(first), self.piece)
        return choice

    def _prompt_entries(self, first) -> list:
        return first.prompt_logprobs or [None] * len(first.prompt_ids)

    def _echoed(self, c: Choice, first, ask: Ask, logprobs: Optional[list] = None) -> tuple[list, list]:
        """(token ids, log-probability entries) of a completion choice: the prompt's first when echoed."""
        out_ids = [s.token_id for s in c.logprobs] if ask.logprobs else []
        entries = list(c.logprobs if logprobs is None else logprobs)
        if logprobs is not None:
            out_ids = [s.token_id for s in logprobs]
        if not ask.echo:
            return out_ids, entries
        prompt_ids, prompt_entries = list(first.prompt_ids), self._prompt_entries(first)
        if ask.echo_only:
            return prompt_ids, prompt_entries
        return prompt_ids + out_ids, prompt_entries + entries

    def _echo_text(self, c: Choice, ask: Ask) -> str:
        return ask.prompt_texts[c.prompt_index] if ask.echo else ""

    async def _stream(self, request_id: str, choices: dict, firsts: list, queue, created: int,
                      ask: Ask) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if ask.chat else "text_completion"

        def chunk(items: list, **extra) -> str:
            return "data: " + json.dumps({"id": request_id, "object": kind, "created": created, "model": self.name,
                                          "choices": items, **extra}) + "\n\n"
        try:
            while not all(c.done for c in choices.values()):
                delta = await queue.get()
                c = choices[delta.request_id]
                opening = not c.opened
                c.opened = True
                # A chat stream's role-only chunk goes out with the first result, after the prefill, as vLLM's
                # server sends it: a client timing TTFT from the first chunk (vllm bench serve) then reads it true.
                if opening and ask.chat:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                c.tokens += len(delta.token_ids)
                if delta.error:
                    c.done = True
                    yield "data: " + json.dumps(self.error_body(f"the model failed on this request: {delta.error}",
                                                                "InternalServerError", 500)) + "\n\n"
                    break
                if delta.finished:
                    c.done = True
                text = delta.text
                if not ask.chat:
                    echo = self._echo_text(c, ask) if opening else ""
                    text = echo + ("" if ask.echo_only else text)
                if text or delta.finished:
                    item: dict = {"index": c.index}
                    if ask.chat:
                        item["delta"] = {"content": text}
                        item["logprobs"] = chat_logprobs(delta.logprobs, self.piece) if ask.logprobs else None
                    else:
                        item["text"] = text
                        item["logprobs"] = None
                        if ask.logprobs:
                            first = firsts[c.prompt_index]
                            own = [] if ask.echo_only else delta.logprobs
                            if opening:
                                ids, entries = self._echoed(c, first, ask, own)
                            else:
                                ids, entries = [s.token_id for s in own], own
                            item["logprobs"] = completion_logprobs(ids, entries, self.piece)
                    item["finish_reason"] = delta.finish_reason if delta.finished else None
                    yield chunk([item])
            if ask.include_usage:
                completion = 0 if ask.echo_only else sum(c.tokens for c in choices.values())
                yield chunk([], usage=usage(sum(len(s.prompt_ids) for s in firsts), completion))
            yield "data: [DONE]\n\n"
        finally:
            for c in choices.values():
                if not c.done:  # disconnected mid-stream (the generator was closed): free the blocks now
                    self.async_engine.abort(c.seq.request_id)

    @staticmethod
    def error_body(message: str, kind: str, code: int, param: Optional[str] = None) -> dict:
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_error(message: str, kind: str, code: int, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(Responder.error_body(message, kind, code, param), status_code=code)
