"""vLLM's own `vllm bench serve` against `kvlab serve` (slow; needs the vLLM venv and SmolLM2).

    flock /tmp/kvlab-heavy.lock python3 -m pytest -p no:cacheprovider -m slow tests/bench/test_vllm_interop.py

Run by hand with figures: `kvlab bench vllm-interop --json PATH` (kvlab.bench.vllm_interop
says what it checks). Build the venv first: scripts/setup_vllm_venv.sh.
"""

from __future__ import annotations

import os

import pytest

from needs import missing, require_smollm2
from kvlab.bench.vllm_interop import COMPARED, agreed_metrics, passed


@pytest.mark.slow
def test_vllm_bench_serve_has_no_failures_against_kvlab_and_agrees_with_kvlab_bench_serve():
    require_smollm2()
    from kvlab.bench.peers import vllm_python
    from kvlab.bench.vllm_interop import interop

    if not os.access(vllm_python(), os.X_OK):
        missing(f"the vLLM venv at {vllm_python()} (scripts/setup_vllm_venv.sh)")
    result = interop(num_prompts=12, concurrency=4, input_len=128, output_len=24, prefix_len=256)
    assert [(p["dataset"], p["endpoint"], p["max_concurrency"]) for p in result["pairs"]] == [
        (dataset, endpoint, level) for dataset, endpoint in (("random", "/v1/completions"), ("prefix_repetition",
                                                             "/v1/completions"), ("random", "/v1/chat/completions"))
        for level in (1, 4)]
    for pair in result["pairs"]:
        for client in ("vllm", "kvlab"):
            assert (pair[client]["completed"], pair[client]["failed"]) == (12, 0), pair
        assert pair["exact_output_tokens"], pair  # 12 x 24 tokens each way: ignore_eos honoured
        # alone, every metric agrees; under load the batching follows each client's timing (vllm_interop)
        assert len(pair["agreed"]) == (6 if pair["max_concurrency"] == 1 else 1)
        for metric in pair["agreed"]:
            ratio = pair["vllm_over_kvlab"][metric]
            assert ratio is not None and 1 / 1.5 <= ratio <= 1.5, (pair["dataset"], metric, ratio)
    assert result["unstreamed"]["failed"] == 0 and set(result["unstreamed"]["completion_tokens"]) == {24}
    assert result["passed"]


def _pair(level: int, **ratios: float) -> dict:
    ok = {"completed": 12, "failed": 0}
    return {"max_concurrency": level, "agreed": list(agreed_metrics(level)), "vllm": ok, "kvlab": ok,
            "exact_output_tokens": True, "vllm_over_kvlab": {m: ratios.get(m, 1.0) for m in COMPARED}}


def test_verdict_judges_every_metric_alone_and_throughput_under_load():
    unstreamed = {"failed": 0, "completion_tokens": [24] * 12}
    assert agreed_metrics(1) == COMPARED and agreed_metrics(4) == ("output_throughput",)
    assert passed([_pair(1), _pair(4, mean_ttft_ms=0.5, mean_tpot_ms=2.2)], unstreamed, 24, 1.5)
    assert not passed([_pair(1, mean_tpot_ms=2.2), _pair(4)], unstreamed, 24, 1.5)  # alone, TPOT must agree
    assert not passed([_pair(1), _pair(4, output_throughput=0.6)], unstreamed, 24, 1.5)
    assert not passed([_pair(1, median_ttft_ms=None)], unstreamed, 24, 1.5)  # a ratio it could not take
    failed = _pair(4)
    failed["kvlab"] = {"completed": 11, "failed": 1}
    assert not passed([_pair(1), failed], unstreamed, 24, 1.5)
    assert not passed([_pair(1)], {"failed": 0, "completion_tokens": [24] * 11 + [23]}, 24, 1.5)
    assert not passed([_pair(1)], {"failed": 1, "completion_tokens": [24] * 11}, 24, 1.5)
