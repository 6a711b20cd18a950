"""The machine's bandwidth is measured once and then read back from the cache file."""

import json

from kvlab.bench import bandwidth


def test_measured_once_then_remembered(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bandwidth, "measure_bandwidth_gbs", lambda: calls.append(1) or 12.5)
    path = tmp_path / "bandwidth.json"
    assert bandwidth.machine_bandwidth_gbs(cache_file=path) == (12.5, "measured now")
    gbs, source = bandwidth.machine_bandwidth_gbs(cache_file=path)
    assert gbs == 12.5 and str(path) in source and len(calls) == 1
    assert next(iter(json.loads(path.read_text()).values()))["gbs"] == 12.5


def test_copy_benchmark_gives_a_positive_figure():
    assert bandwidth.measure_bandwidth_gbs(buffer_bytes=8 << 20, repeats=2) > 0
