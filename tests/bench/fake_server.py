"""A tiny OpenAI-shaped streaming server on loopback with known timing, to test the load generator.

Each completion streams `max_tokens` one-word chunks `gap_s` apart (the first after `ttft_s`),
then a usage chunk when asked for it; a chat stream opens with a role-only chunk at once.
`strict=True` refuses vLLM's extras with a 400, as a server without them would; a prompt
containing FAIL is a 500.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServer:
    def __init__(self, ttft_s: float = 0.05, gap_s: float = 0.02, strict: bool = False) -> None:
        self.ttft_s, self.gap_s, self.strict = ttft_s, gap_s, strict
        self.bodies: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:
                pass

            def reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.reply(200, {"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.bodies.append(body)
                if fake.strict and ("ignore_eos" in body or "stream_options" in body):
                    return self.reply(400, {"error": {"message": "unknown field ignore_eos", "code": 400}})
                if "FAIL" in json.dumps(body.get("prompt", body.get("messages"))):
                    return self.reply(500, {"error": {"message": "boom", "code": 500}})
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                n = body.get("max_tokens") or body.get("max_completion_tokens")
                try:
                    if "messages" in body:  # a role-only opening chunk at once, as kvlab's server sends it
                        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        self.wfile.write(f"data: {json.dumps({'choices': [opening]})}\n\n".encode())
                        self.wfile.flush()
                    time.sleep(fake.ttft_s)
                    for i in range(n):
                        if i:
                            time.sleep(fake.gap_s)
                        choice = {"index": 0, "text": " w"} if "prompt" in body else \
                            {"index": 0, "delta": {"content": " w"}}
                        self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                        self.wfile.flush()
                    if (body.get("stream_options") or {}).get("include_usage"):
                        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client hung up

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> None:
    """`python fake_server.py PORT [--strict]`: serve until killed (a peer for `kvlab bench compare`'s tests)."""
    import sys

    server = FakeServer(ttft_s=0.02, gap_s=0.005, strict="--strict" in sys.argv)
    server.httpd.server_close()
    server.httpd = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), server.httpd.RequestHandlerClass)
    server.httpd.daemon_threads = True
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
