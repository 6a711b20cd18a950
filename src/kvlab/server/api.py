"""The OpenAI-compatible routes: completions and chat completions (streamed or not), models, health,
metrics, and vLLM's /tokenize, /detokenize, /tokenizer_info and /reset_prefix_cache.

Errors come in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a body
that is malformed, mistyped or asks for something impossible (kvlab.errors.KvlabError, mapped
here once; FastAPI's own refusals too), 401 without the API key, 404 for an unknown model or
route, 503 when too many requests wait,
500 when the model itself fails. A client that disconnects mid-stream aborts its request.
"""

from __future__ import annotations

import time
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvlab import __version__
from kvlab.engine.errors import EngineOverloaded, RequestError
from kvlab.errors import KvlabError
from kvlab.server.async_engine import AsyncEngine
from kvlab.server.metrics import Metrics
from kvlab.server.protocol import ChatCompletionRequest, CompletionRequest
from kvlab.server.responder import Ask, Responder, json_error as error
from kvlab.server.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, tokenizer_info


def create_app(async_engine: AsyncEngine, served_model_name: str, api_key: Optional[str] = None,
               metric_names: str = "both", tokenizer_info_endpoint: bool = False) -> FastAPI:
    app = FastAPI(title="kvlab", version=__version__)
    engine = async_engine.engine
    metrics = Metrics(engine, served_model_name, metric_names)
    app.state.async_engine, app.state.metrics = async_engine, metrics
    responder = Responder(async_engine, served_model_name, error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, RequestError):  # raised while the body was parsed (a removed guided_* field)
            return error(str(cause), "BadRequestError", 400, cause.param)
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
        params = body.params()
        prompts = body.prompts()
        tokenizer = engine.tokenizer
        if not body.add_special_tokens and tokenizer is not None:
            prompts = [tokenizer.encode(p, add_bos=False) if isinstance(p, str) else p for p in prompts]
        texts = []
        if body.echo:  # the prompt as the client sent it; token ids as their text, as vLLM echoes them
            texts = [p if isinstance(p, str) else (tokenizer.decode(p) if tokenizer is not None else "")
                     for p in body.prompts()]
        ask = Ask(chat=False, stream=body.stream, include_usage=bool(body.stream_options and
                                                                     body.stream_options.include_usage),
                  echo=body.echo, echo_only=body.echo_only, logprobs=body.logprobs is not None,
                  prompt_logprobs=body.prompt_logprobs is not None, prompt_texts=texts)
        return await responder.respond(request, ask, prompts, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if (missing := check_model(body.model)) is not None:
            return missing
        tools = body.tool_structure()
        prompt = chat_prompt(body.conversation())
        top = body.top_logprobs if body.logprobs else None
        params = body.sampling(body.max_completion_tokens or body.max_tokens, (top or 0) if body.logprobs else None,
                               structured=tools)
        ask = Ask(chat=True, stream=body.stream, include_usage=bool(body.stream_options and
                                                                    body.stream_options.include_usage),
                  logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs is not None,
                  tool_body=body if tools is not None else None)
        return await responder.respond(request, ask, [prompt], params)

    def chat_prompt(conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        tokenizer = engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        text = tokenizer.render_chat(conversation, add_generation_prompt)
        return tokenizer.encode(text, add_bos=False if tokenizer.bos_id is None else None)

    @app.post("/tokenize")
    async def tokenize(body: Union[TokenizeCompletionRequest, TokenizeChatRequest]):
        """vLLM's /tokenize: a prompt (or chat messages, through the template) to token ids."""
        if body.model is not None and (missing := check_model(body.model)) is not None:
            return missing
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise RequestError("this model has no tokenizer", "prompt")
        if isinstance(body, TokenizeChatRequest):
            ids = chat_prompt(body.conversation(), body.add_generation_prompt)
        else:
            ids = tokenizer.encode(body.prompt, add_bos=None if body.add_special_tokens else False)
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.token(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None and (missing := check_model(body.model)) is not None:
            return missing
        vocab = engine.model.config.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise RequestError(f"token ids must be in [0, {vocab})", "tokens")
        if engine.tokenizer is None:
            raise RequestError("this model has no tokenizer", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    if tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info_page() -> dict:
            """vLLM's (behind --enable-tokenizer-info-endpoint, as there): what lm-eval's remote tokenizer reads."""
            if engine.tokenizer is None:
                raise RequestError("this model has no tokenizer")
            return tokenizer_info(engine.tokenizer, engine.max_model_len)

    return app
