"""`kvlab serve MODEL`: the OpenAI-compatible server (FastAPI + uvicorn) over kvlab's engine."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from kvlab.commands.args import positive_int
from kvlab.commands.engine_args import add_engine_arguments, engine_from_args


def add_parser(subparsers, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=f"{help_text}. Flags follow vLLM's names.")
    add_engine_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
    server.add_argument("--api-key", default=os.environ.get("KVLAB_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1/* (default: $KVLAB_API_KEY, else none)")
    server.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    server.add_argument("--max-waiting-requests", type=positive_int, default=256,
                        help="answer 503 once this many requests wait (default 256)")
    server.add_argument("--stream-interval", type=positive_int, default=1,
                        help="stream each request's tokens N at a time: the first at once, then every N, the rest at "
                             "the end (as vLLM's; fewer chunks cost the server less at many streams; default 1)")
    server.add_argument("--metric-names", default="both", choices=("both", "kvlab", "vllm"),
                        help="/metrics under kvlab: names, vLLM's vllm: names (existing dashboards), or both "
                             "(default both)")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info (vLLM's flag; lm-eval's remote tokenizer reads it)")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvlab.server.api import create_app
    from kvlab.server.async_engine import AsyncEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    log = logging.getLogger("kvlab.serve")
    engine = engine_from_args(args)
    name = args.served_model_name or args.model
    log.info("model %s: %s weights, %s activations, decode %s, max_model_len %d", name, engine.model.packing,
             args.dtype, engine.decode_path, engine.max_model_len)
    async_engine = AsyncEngine(engine, args.max_waiting_requests, args.stream_interval)
    app = create_app(async_engine, name, args.api_key, args.metric_names, args.enable_tokenizer_info_endpoint)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM/SIGINT: stop accepting, abort what runs, exit 0
            async_engine.abort_all()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn re-raises the signal after shutting down (exit -15); a stop asked for is a clean exit."""
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    async_engine.start()
    try:
        Server(config).run()
    finally:
        async_engine.stop()
    return 0
