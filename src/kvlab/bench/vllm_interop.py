"""vLLM's own serving benchmark against `kvlab serve`, and `kvlab bench serve` on the same workload beside it.

    flock /tmp/kvlab-heavy.lock kvlab bench vllm-interop [--model smollm2-135m] [--json PATH]

Users compare engines with `vllm bench serve`, so kvlab's server must pass it. This starts one
`kvlab serve MODEL` and, for each of vLLM's `random` and `prefix_repetition` datasets, runs
vLLM's benchmark (`vllm.benchmarks.serve`'s `add_cli_args` + `main`, from the vLLM venv that
scripts/setup_vllm_venv.sh builds: its `vllm` console script fails looking up its own version)
(and `random` once more on /v1/chat/completions, vLLM's openai-chat backend)
and then `kvlab bench serve` with the same lengths, seed, concurrency and prompt count; each
pair's TTFT, TPOT and output throughput are set side by side as ratios. vLLM's client always
streams (its request functions send `stream: true` and parse server-sent events), so the
non-streamed half is a pass of the same prompts with `stream: false` through the official
`openai` client. Pass means: zero failed requests everywhere, every request got its exact
`max_tokens` (ignore_eos), and each ratio within `--tolerance` (run-to-run noise on a shared
machine). tests/bench/test_vllm_interop.py (slow) runs it.

Both clients draw the same prompts from the same seed, so the second run of a pair used to be
served from the first one's cached prefixes (its TTFT 1.3-2x shorter: the check failed on
that, not on the server). Every run now starts from `POST /reset_prefix_cache` (vLLM's
endpoint, which kvlab serve has too), an unrecorded warm-up run comes first, and the pairs
alternate which client goes first.

Each workload runs at two concurrencies, and what must agree differs (`agreed_metrics`). At
concurrency 1 a request is served alone, so its TTFT (its prefill) and TPOT (one-row steps) do not
depend on the client: every metric must agree. Under load (`--max-concurrency`, 4) a closed loop
of equal requests is batched by when each client's next request lands: on a 2-core EPYC kvlab's
client kept its four requests in step (their prefills in one step, then four-row decodes:
long TTFT, short TPOT) while vLLM's drifted apart (each prefill landing between the others'
decode steps: short TTFT, long TPOT), so TTFT and TPOT moved up to 2x in opposite directions
while the two output throughputs stayed close. There the served tokens per second must agree,
failures must be zero and every request must get its tokens; the TTFT/TPOT ratios are
recorded, not judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from typing import Optional

VLLM_BENCH = ("import argparse, sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "parser = argparse.ArgumentParser()\n"
              "add_cli_args(parser)\n"
              "main(parser.parse_args(sys.argv[1:]))\n")
COMPARED = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms")


def agreed_metrics(concurrency: int) -> tuple[str, ...]:
    """What two clients' runs of one workload must agree on (module docstring): every metric served
    one request at a time, the output throughput under load."""
    return COMPARED if concurrency == 1 else ("output_throughput",)


def dataset_flags(dataset: str, input_len: int, output_len: int, prefix_len: int) -> tuple[list[str], list[str]]:
    """(vLLM's flags, kvlab bench serve's flags) for the same workload."""
    if dataset == "random":
        return (["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
                 str(output_len), "--random-range-ratio", "0", "--ignore-eos"],
                ["--dataset-name", "random", "--input-len", str(input_len), "--output-len", str(output_len)])
    return (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
             "--prefix-repetition-suffix-len", str(input_len), "--prefix-repetition-num-prefixes", "1",
             "--prefix-repetition-output-len", str(output_len), "--ignore-eos"],
            ["--dataset-name", "prefix-repetition", "--prefix-len", str(prefix_len), "--suffix-len", str(input_len),
             "--num-prefixes", "1", "--output-len", str(output_len), "--ignore-eos"])


def run_vllm_bench(python: str, base_url: str, model: str, tokenizer_dir: str, flags: list[str], num_prompts: int,
                   concurrency: int, seed: int, workdir: str, endpoint: str = "/v1/completions") -> dict:
    """vLLM's benchmark in its venv; its result JSON (vLLM's field names)."""
    name = f"vllm-{len(os.listdir(workdir))}.json"
    argv = [python, "-c", VLLM_BENCH, "--backend", "openai-chat" if "chat" in endpoint else "openai",
            "--base-url", base_url, "--endpoint", endpoint, "--model", model, "--tokenizer", tokenizer_dir,
            *flags, "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--temperature", "0",
            "--save-result", "--result-dir", workdir, "--result-filename", name, "--disable-tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("PYTHONPATH", None)  # the venv's own packages only
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {done.returncode}: {done.stderr[-2000:]}")
    with open(os.path.join(workdir, name)) as f:
        return json.load(f)


def reset_prefix_cache(base_url: str) -> None:
    """Forget the server's cached prefixes, so the next run starts cold."""
    import httpx

    httpx.post(base_url + "/reset_prefix_cache", timeout=60).raise_for_status()


def run_kvlab_bench(base_url: str, model: str, tokenizer: str, flags: list[str], num_prompts: int,
                    concurrency: int, seed: int, workdir: str, endpoint: str = "/v1/completions") -> dict:
    from kvlab.bench.cli_child import kvlab_cli

    path = os.path.join(workdir, f"kvlab-{len(os.listdir(workdir))}.json")
    done = kvlab_cli(["bench", "serve", "--base-url", base_url, "--model", model, "--tokenizer", tokenizer,
               "--endpoint", endpoint, *flags, "--num-prompts", str(num_prompts), "--max-concurrency",
               str(concurrency), "--seed", str(seed), "--temperature", "0", "--metric-percentiles", "50,99",
               "--result-file", path, "--disable-tqdm"], timeout=None)
    if done.returncode != 0:
        raise RuntimeError(f"kvlab bench serve exited {done.returncode}: {done.stderr[-500:]}")
    with open(path) as f:
        return json.load(f)


async def _unstreamed(base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    """The prompts with stream=false through the openai client: failures and completion-token counts."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str):
        async with gate:
            try:
                reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0, extra_body={"ignore_eos": True})
                return reply.usage.completion_tokens, None
            except Exception as error:  # every failure is counted, with its text
                return 0, f"{type(error).__name__}: {error}"

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    errors = [e for _, e in results if e]
    return {"requests": len(prompts), "failed": len(errors), "first_errors": errors[:3],
            "completion_tokens": [n for n, _ in results], "duration": time.perf_counter() - started}


def interop(model: str = "smollm2-135m", vllm_python: Optional[str] = None, num_prompts: int = 16,
            concurrency: int = 4, input_len: int = 128, output_len: int = 32, prefix_len: int = 256, seed: int = 0,
            threads: int = 0, tolerance: float = 1.5) -> dict:
    """Both clients on both datasets against one `kvlab serve MODEL`; the result with `passed`."""
    from kvlab.bench.hf_export import hf_dir_for
    from kvlab.bench.peers import Peer, Running, free_ports, known_peer, vllm_python as find_python
    from kvlab.bench.provenance import provenance
    from kvlab.checkpoints.resolve import resolve_model_path

    python = find_python(vllm_python)
    if not os.access(python, os.X_OK):
        raise SystemExit(f"no vLLM venv python at {python}: run scripts/setup_vllm_venv.sh first")
    gguf = resolve_model_path(model)
    hf_dir = hf_dir_for(gguf)  # vLLM's client needs an HF tokenizer: kvlab's export carries the GGUF's
    port = free_ports(1)[0]
    peer = known_peer("kvlab", port, gguf, None, threads or os.cpu_count() or 1, "kvlab-bench", "1GiB")
    assert isinstance(peer, Peer)
    server = Running(peer, port)
    pairs, unstreamed = [], {}
    try:
        with tempfile.TemporaryDirectory(prefix="kvlab-interop-") as workdir:
            warm_up = dataset_flags("random", input_len, output_len, prefix_len)[1]
            run_kvlab_bench(server.base_url, "kvlab-bench", gguf, warm_up, concurrency, concurrency, seed + 1,
                            workdir)  # the first requests a server answers pay one-time costs: not recorded
            cells = [(dataset, endpoint, level) for dataset, endpoint in (("random", "/v1/completions"),
                                                                         ("prefix_repetition", "/v1/completions"),
                                                                         ("random", "/v1/chat/completions"))
                     for level in dict.fromkeys((1, concurrency))]
            for index, (dataset, endpoint, level) in enumerate(cells):
                theirs_flags, ours_flags = dataset_flags(dataset, input_len, output_len, prefix_len)
                clients = {
                    "vllm": lambda: run_vllm_bench(python, server.base_url, "kvlab-bench", hf_dir, theirs_flags,
                                                   num_prompts, level, seed, workdir, endpoint),
                    "kvlab": lambda: run_kvlab_bench(server.base_url, "kvlab-bench", gguf, ours_flags, num_prompts,
                                                     level, seed, workdir, endpoint)}
                order = ("vllm", "kvlab") if index % 2 == 0 else ("kvlab", "vllm")
                runs = {}
                for client in order:
                    reset_prefix_cache(server.base_url)
                    runs[client] = clients[client]()
                pairs.append({"endpoint": endpoint, "max_concurrency": level, "first": order[0],
                              "agreed": list(agreed_metrics(level)),
                              **_pair(dataset, runs["vllm"], runs["kvlab"], num_prompts * output_len)})
            from kvlab.bench.serve_data import load_tokenizer, random_requests
            prompts = [r.prompt for r in random_requests(num_prompts, input_len, output_len, 0.0, 0, seed,
                                                         load_tokenizer(gguf))]
            unstreamed = asyncio.run(_unstreamed(server.base_url, "kvlab-bench", prompts, output_len, concurrency))
    finally:
        server.stop()
    return {"benchmark": "vllm_interop", "model": model, "num_prompts": num_prompts, "max_concurrency": concurrency,
            "input_len": input_len, "output_len": output_len, "prefix_len": prefix_len, "seed": seed,
            "tolerance": tolerance, "pairs": pairs, "unstreamed": unstreamed,
            "passed": passed(pairs, unstreamed, output_len, tolerance), "provenance": provenance(threads or None)}


def passed(pairs: list[dict], unstreamed: dict, output_len: int, tolerance: float) -> bool:
    """The verdict: no failed request anywhere, every request its exact tokens, and each pair's
    agreed ratios (`agreed_metrics`) within [1/tolerance, tolerance]."""
    exact = unstreamed["failed"] == 0 and all(n == output_len for n in unstreamed["completion_tokens"])
    within = all(p["vllm_over_kvlab"][m] is not None and 1 / tolerance <= p["vllm_over_kvlab"][m] <= tolerance
                 for p in pairs for m in p["agreed"])
    clean = all(p["vllm"]["failed"] == 0 and p["kvlab"]["failed"] == 0 and p["exact_output_tokens"] for p in pairs)
    return exact and within and clean


def _pair(dataset: str, theirs: dict, ours: dict, expected_tokens: int) -> dict:
    keep = ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration") + COMPARED
    return {"dataset": dataset,
            "vllm": {k: theirs.get(k) for k in keep}, "kvlab": {k: ours.get(k) for k in keep},
            "exact_output_tokens": theirs.get("total_output_tokens") == ours.get("total_output_tokens")
            == expected_tokens,
            "vllm_over_kvlab": {k: (theirs[k] / ours[k] if theirs.get(k) and ours.get(k) else None)
                                for k in COMPARED}}


def run_command(args: argparse.Namespace) -> int:
    """`kvlab bench vllm-interop`: every pair printed, PASSED or FAILED, --json written; exit 1 when failed."""
    result = interop(args.model, args.vllm_python, args.num_prompts, args.max_concurrency, args.input_len,
                     args.output_len, args.prefix_len, args.seed, args.threads, args.tolerance)
    for pair in result["pairs"]:
        v, k = pair["vllm"], pair["kvlab"]
        print(f"{pair['dataset']} {pair['endpoint']} concurrency {pair['max_concurrency']}: vllm bench serve "
              f"{v['completed']} ok / {v['failed']} failed, {v['output_throughput']:.1f} tok/s, "
              f"TTFT {v['mean_ttft_ms']:.0f} ms, TPOT {v['mean_tpot_ms']:.1f} ms; "
              f"kvlab bench serve {k['completed']} ok / {k['failed']} failed, {k['output_throughput']:.1f} tok/s, "
              f"TTFT {k['mean_ttft_ms']:.0f} ms, TPOT {k['mean_tpot_ms']:.1f} ms; ratios "
              + ", ".join(f"{m} {r:.2f}" + ("" if m in pair["agreed"] else " (not judged)")
                          for m, r in pair["vllm_over_kvlab"].items() if r is not None))
    u = result["unstreamed"]
    print(f"stream=false (openai client): {u['requests'] - u['failed']} ok / {u['failed']} failed, completion "
          f"tokens {sorted(set(u['completion_tokens']))}")
    print("PASSED" if result["passed"] else "FAILED")
    if args.json:
        from kvlab.files import write_json
        write_json(args.json, result)
    return 0 if result["passed"] else 1
