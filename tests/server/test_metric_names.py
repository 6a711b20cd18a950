"""/metrics under kvlab:, vllm: or both (`--metric-names`): the same families under each prefix."""

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from kvlab.server.metrics import Metrics


def fake_engine():
    blocks = SimpleNamespace(usage=0.25, prefix_queries=10, prefix_hits=4)
    return SimpleNamespace(num_running=2, num_waiting=1, blocks=blocks, scheduler=SimpleNamespace(num_preemptions=0),
                           prompt_tokens_total=30, generation_tokens_total=12, speculative=None, on_finish=[])


@pytest.mark.parametrize("names,present,absent", [("both", ("kvlab:", "vllm:"), ()), ("vllm", ("vllm:",), ("kvlab:",)),
                                                  ("kvlab", ("kvlab:",), ("vllm:",))])
def test_metric_prefixes(names, present, absent):
    engine = fake_engine()
    metrics = Metrics(engine, "m", names)
    engine.on_finish[0](SimpleNamespace(first_token_time=1.0, arrival=0.5, token_times=[1.0, 1.1],
                                        last_token_time=1.1))
    text = generate_latest(metrics.registry).decode()
    for prefix in present:
        assert f'{prefix}kv_cache_usage_perc{{model_name="m"}} 0.25' in text
        assert f'{prefix}prompt_tokens_total{{model_name="m"}} 30.0' in text
        assert f'{prefix}time_to_first_token_seconds_count{{model_name="m"}} 1.0' in text
    for prefix in absent:
        assert prefix not in text
    with pytest.raises(ValueError):
        Metrics(fake_engine(), "m", "prometheus")
