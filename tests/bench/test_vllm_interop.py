"""vLLM's own `vllm bench serve` against `kvlab serve` (slow; needs the vLLM venv and SmolLM2).

    flock /tmp/kvlab-heavy.lock python3 -m pytest -p no:cacheprovider -m slow tests/bench/test_vllm_interop.py

Run by hand with figures: `python -m kvlab.bench.vllm_interop --json PATH` (kvlab.bench.vllm_interop
says what it checks). Build the venv first: scripts/setup_vllm_venv.sh.
"""

from __future__ import annotations

import os

import pytest

from needs import missing, require_smollm2


@pytest.mark.slow
def test_vllm_bench_serve_has_no_failures_against_kvlab_and_agrees_with_kvlab_bench_serve():
    require_smollm2()
    from kvlab.bench.peers import vllm_python
    from kvlab.bench.vllm_interop import interop

    if not os.access(vllm_python(), os.X_OK):
        missing(f"the vLLM venv at {vllm_python()} (scripts/setup_vllm_venv.sh)")
    result = interop(num_prompts=12, concurrency=4, input_len=128, output_len=24, prefix_len=256)
    assert [(p["dataset"], p["endpoint"]) for p in result["pairs"]] == [
        ("random", "/v1/completions"), ("prefix_repetition", "/v1/completions"), ("random", "/v1/chat/completions")]
    for pair in result["pairs"]:
        for client in ("vllm", "kvlab"):
            assert (pair[client]["completed"], pair[client]["failed"]) == (12, 0), pair
        assert pair["exact_output_tokens"], pair  # 12 x 24 tokens each way: ignore_eos honoured
        for metric, ratio in pair["vllm_over_kvlab"].items():
            assert ratio is not None and 1 / 1.5 <= ratio <= 1.5, (pair["dataset"], metric, ratio)
    assert result["unstreamed"]["failed"] == 0 and set(result["unstreamed"]["completion_tokens"]) == {24}
    assert result["passed"]
