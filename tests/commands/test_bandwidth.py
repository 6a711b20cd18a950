"""The machine's bandwidth is measured once and then read back from the cache file."""

import json

import pytest

from kvlab.bench import bandwidth


def test_measured_once_then_remembered(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bandwidth, "measure_bandwidth_gbs", lambda: calls.append(1) or 12.5)
    path = tmp_path / "bandwidth.json"
    assert bandwidth.machine_bandwidth_gbs(cache_file=path) == (12.5, "measured now")
    gbs, source = bandwidth.machine_bandwidth_gbs(cache_file=path)
    assert gbs == 12.5 and str(path) in source and len(calls) == 1
    assert next(iter(json.loads(path.read_text()).values()))["gbs"] == 12.5


def test_figure_is_bytes_read_and_written_over_the_fastest_copy(monkeypatch):
    """Fake clock: copies of 4, 2 and 3 ms; 8 MiB read plus 8 MiB written in the best 2 ms."""
    ticks = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.003])
    monkeypatch.setattr(bandwidth.time, "perf_counter", lambda: next(ticks))
    assert bandwidth.measure_bandwidth_gbs(buffer_bytes=8 << 20, repeats=3) == pytest.approx(2 * (8 << 20) / 0.002 / 1e9)


def test_real_copy_gives_a_plausible_figure():
    """Any machine kvlab runs on copies between 0.1 GB/s and 10 TB/s."""
    assert 0.1 < bandwidth.measure_bandwidth_gbs(buffer_bytes=8 << 20, repeats=2) < 10_000
