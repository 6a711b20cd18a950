"""Start a real `kvlab serve` process on a free loopback port, and read its /metrics."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, model: str, *flags: str, name: str = "test-model", port: Optional[int] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        self.port = port or free_port()
        self.name = name
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "kvlab.cli", "serve", model, "--port", str(self.port),
                "--served-model-name", name, "--threads", "1", "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvlab serve exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("kvlab serve did not start within 120 s")

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS in /proc/PID/status)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            match = re.match(r"^kvlab:(\w+)\{[^}]*\} ([0-9.e+-]+)$", line)
            if match:
                out[match.group(1)] = float(match.group(2))
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once nothing runs or waits and every block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
