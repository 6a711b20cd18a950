#!/usr/bin/env python3
"""What the README shows of `kvlab serve`: start it, ask it with the openai client, stop it.

    python3 scripts/serve_demo.py [MODEL] [--prompt TEXT] [--to-mla] [SERVE FLAGS...]   # default smollm2-135m

Starts `kvlab serve MODEL --kv-cache-memory 256MiB [SERVE FLAGS]` on a free loopback port,
prints the capacity lines the server logged, one completion (greedy, streamed: a chat
completion of "What is the capital of France?", or with --prompt a text completion, for a
model without a chat template) and its usage, and the server's Prometheus counters for it,
then stops the server with SIGTERM. With --to-mla the model is first converted to MLA at full
rank (`kvlab convert MODEL --to mla --layout kvlab --kv-lora-rank full`, exact) into a temporary directory,
which is what is served.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai


def main() -> int:
    args = sys.argv[1:]
    model = args.pop(0) if args and not args[0].startswith("-") else "smollm2-135m"
    prompt = None
    if "--prompt" in args:
        at = args.index("--prompt")
        prompt = args[at + 1]
        del args[at:at + 2]
    if "--to-mla" in args:
        args.remove("--to-mla")
        converted = os.path.join(tempfile.mkdtemp(prefix="kvlab-demo-"), "mla")
        subprocess.run([sys.executable, "-m", "kvlab.cli", "convert", model, "--to", "mla", "--layout", "kvlab",
                        "--kv-lora-rank", "full", "-o", converted], check=True, capture_output=True)
        print(f"[convert] {model} -> MLA at full rank (exact)")
        model = converted
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = os.path.basename(model) if os.path.isdir(model) else model
    argv = [sys.executable, "-m", "kvlab.cli", "serve", model, "--kv-cache-memory", "256MiB", "--port", str(port),
            "--served-model-name", name, *args]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    lines = []
    try:
        for line in server.stderr:
            lines.append(line.rstrip())
            if line.startswith("INFO kvlab.serve"):
                break
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()  # keep the pipe drained
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # where products run depends on this machine's measured crossover: logged, not shown here
        print("\n".join(f"[server] {line}" for line in lines
                        if line.startswith("INFO kvlab") and not line.startswith("INFO kvlab.engine: products:")))
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        options = dict(model=name, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
        if prompt is None:
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            print(f"[client] {messages[0]['content']}")
            stream = client.chat.completions.create(messages=messages, **options)
        else:
            print(f"[client] {prompt}")
            stream = client.completions.create(prompt=prompt, **options)
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                text += (choice.delta.content if prompt is None else choice.text) or ""
            if chunk.usage:
                usage = chunk.usage
        print(f"[client] {text}")
        print(f"[client] usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")
        metrics = [m for m in httpx.get(base + "/metrics").text.splitlines()
                   if m.startswith(("kvlab:prompt_tokens_total", "kvlab:generation_tokens_total",
                                    "kvlab:kv_cache_usage_perc"))]
        print("\n".join(f"[metrics] {m}" for m in metrics))
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(30)
        print(f"[server] SIGTERM: exit {code}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
