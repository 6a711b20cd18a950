"""The OpenAI-compatible routes: completions and chat completions (streamed or not), models, health, metrics.

Errors come in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a body
that is malformed, mistyped or asks for something impossible (kvlab.errors.KvlabError, mapped
here once; FastAPI's own refusals too), 401 without the API key, 404 for an unknown model or
route, 503 when too many requests wait,
500 when the model itself fails. A client that disconnects mid-stream aborts its request.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvlab import __version__
from kvlab.engine.errors import EngineOverloaded, RequestError
from kvlab.errors import KvlabError
from kvlab.server.async_engine import AsyncEngine
from kvlab.server.metrics import Metrics
from kvlab.server.protocol import ChatCompletionRequest, CompletionRequest


def error_body(message: str, kind: str, code: int, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(message: str, kind: str, code: int, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=code)


def create_app(async_engine: AsyncEngine, served_model_name: str, api_key: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="kvlab", version=__version__)
    engine = async_engine.engine
    metrics = Metrics(engine, served_model_name)
    app.state.async_engine, app.state.metrics = async_engine, metrics

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}", "BadRequestError", 400,
                     where)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """FastAPI's own refusals (a body that is not UTF-8 or nests too deep, an unknown route) in OpenAI's shape."""
        kinds = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}
        return error(str(exc.detail), kinds.get(exc.status_code, "BadRequestError"), exc.status_code)

    @app.exception_handler(KvlabError)
    async def refused(_: Request, exc: KvlabError) -> JSONResponse:
        if isinstance(exc, EngineOverloaded):
            return error(str(exc), "ServiceUnavailableError", 503)
        return error(str(exc), "BadRequestError", 400, getattr(exc, "param", None))

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and (request.url.path.startswith("/v1/") or request.url.path == "/reset_prefix_cache") and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            return error("invalid or missing API key (Authorization: Bearer KEY)", "AuthenticationError", 401)
        return await call_next(request)

    def check_model(name: str) -> Optional[JSONResponse]:
        if name != served_model_name:
            return error(f"The model `{name}` does not exist.", "NotFoundError", 404, "model")
        return None

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """vLLM's endpoint of that name: a benchmark calls it so that a run is not served from the
        last run's prefixes. Behind --api-key, like /v1/, since it changes what the server holds."""
        return {"reset_blocks": async_engine.reset_prefix_cache()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kvlab", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (missing := check_model(body.model)) is not None:
            return missing
        params = body.sampling(body.max_tokens, body.logprobs)
        return await respond(request, body, body.single_prompt(), params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if (missing := check_model(body.model)) is not None:
            return missing
        tokenizer = engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        text = tokenizer.render_chat(body.conversation())
        prompt = tokenizer.encode(text, add_bos=False if tokenizer.bos_id is None else None)
        top = body.top_logprobs if body.logprobs else None
        params = body.sampling(body.max_completion_tokens or body.max_tokens, (top or 0) if body.logprobs else None)
        return await respond(request, body, prompt, params, chat=True)

    async def respond(request: Request, body, prompt, params, chat: bool):
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        seq, queue = async_engine.submit(prompt, params, request_id)
        created = int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(request, request_id, seq, queue, created, chat, usage),
                                     media_type="text/event-stream")
        text, tokens, logprobs, reason, failure = [], 0, [], None, None
        try:
            while True:
                delta = await queue.get()
                text.append(delta.text)
                tokens += len(delta.token_ids)
                logprobs += delta.logprobs
                if delta.finished:
                    reason, failure = delta.finish_reason, delta.error
                    break
        finally:
            if reason is None:  # the client went away while we waited
                async_engine.abort(request_id)
        if failure:
            return error(f"the model failed on this request: {failure}", "InternalServerError", 500)
        choice = {"index": 0, "finish_reason": reason, "logprobs": _logprobs(logprobs, engine, chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": served_model_name, "choices": [choice],
                "usage": _usage(len(seq.prompt_ids), tokens)}

    async def stream(request: Request, request_id: str, seq, queue, created: int, chat: bool,
                     usage: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        tokens, done = 0, False

        def chunk(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": request_id, "object": kind, "created": created,
                                          "model": served_model_name, "choices": choices, **extra}) + "\n\n"
        # A chat stream's role-only chunk goes out with the first result, after the prefill, as vLLM's server
        # sends it: a client timing TTFT from the first chunk (vllm bench serve's openai-chat) then reads it true.
        opening = chat
        try:
            while True:
                delta = await queue.get()
                if opening:
                    opening = False
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                tokens += len(delta.token_ids)
                if delta.error:
                    yield "data: " + json.dumps(error_body(f"the model failed on this request: {delta.error}",
                                                           "InternalServerError", 500)) + "\n\n"
                    done = True
                    break
                if delta.text or delta.finished:
                    content = {"delta": {"content": delta.text}} if chat else {"text": delta.text}
                    yield chunk([{"index": 0, **content, "logprobs": _logprobs(delta.logprobs, engine, chat),
                                  "finish_reason": delta.finish_reason if delta.finished else None}])
                if delta.finished:
                    done = True
                    break
            if usage:
                yield chunk([], usage=_usage(len(seq.prompt_ids), tokens))
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # disconnected mid-stream (the generator was closed): free the blocks now
                async_engine.abort(request_id)

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _logprobs(sampled: list, engine, chat: bool) -> Optional[dict]:
    if not sampled:
        return None
    tok = engine.tokenizer

    def piece(token_id: int) -> str:
        return tok.decode([token_id]) if tok is not None else str(token_id)
    if chat:
        return {"content": [{"token": piece(s.token_id), "logprob": s.logprob,
                             "top_logprobs": [{"token": piece(t), "logprob": lp} for t, lp in (s.top_logprobs or [])]}
                            for s in sampled]}
    return {"tokens": [piece(s.token_id) for s in sampled], "token_logprobs": [s.logprob for s in sampled],
            "top_logprobs": [{piece(t): lp for t, lp in (s.top_logprobs or [])} for s in sampled]}
