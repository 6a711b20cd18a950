"""kvlab.bench.startup's bookkeeping (medians, ratios, interleaving) and the page written from it,
on stand-in timings: real start-ups take seconds each and belong to the benchmark, not the suite."""

import json

from kvlab.bench import startup
from kvlab.report.startup_report import render


def test_rounds_alternate_trees_and_medians_and_ratios_follow_the_samples(monkeypatch):
    calls = []
    figures = {"a": iter([1.0, 3.0, 2.0]), "b": iter([0.5, 0.25, 1.0])}  # each tree's counted rounds

    def fake_round(kvlab, gguf, model, env):
        label = "a" if env["PYTHONPATH"].startswith("/src-a") else "b"
        calls.append(label)
        value = next(figures[label]) if len(calls) > 2 else 99.0  # the warm-up round is not counted
        return {measure: value for measure in startup.MEASURES}

    monkeypatch.setattr(startup, "round_of", fake_round)
    results = startup.run_bench({"a": "/src-a", "b": "/src-b"}, runs=3, warmup=1, kvlab="kvlab", gguf="x.gguf",
                                model="m", report=lambda line: None)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # the order flips every round
    engine = results["engine"]
    assert engine["samples_s"] == {"a": [1.0, 3.0, 2.0], "b": [0.5, 0.25, 1.0]}
    assert engine["median_s"] == {"a": 2.0, "b": 0.5}
    assert engine["ratio_to_a"] == {"a": 1.0, "b": 0.25}


def test_pycache_runs_write_bytecode_under_the_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = startup._env("src", str(tmp_path))
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] == str(tmp_path)
    assert env["PYTHONPATH"].split(":")[0].endswith("src")
    assert startup._env("src")["PYTHONDONTWRITEBYTECODE"] == "1"


def test_the_page_shows_each_runs_medians_and_ratio(tmp_path):
    results = {measure: {"median_s": {"main": 2.0, "branch": 0.5}} for measure in startup.MEASURES}
    record = {"trees": {"main": {"src": "/m", "git_commit": "a" * 40}, "branch": {"src": "/b", "git_commit": None}},
              "runs": 5, "warmup": 1, "bytecode": "cached", "kvlab_executable": "kvlab", "results": results,
              "provenance": {"time_utc": "T", "machine": {"cpu": "cpu", "cores": 2}, "torch_version": "t",
                             "python_version": "p"}}
    (tmp_path / "startup.json").write_text(json.dumps(record))
    (tmp_path / "notes.md").write_text("hand-written")
    page = render(tmp_path)
    assert "| process start to `LLMEngine` ready | 2.000 | 0.500 | 0.25 |" in page
    assert "main = /m at aaaaaaa, branch = /b at unknown" in page
    assert page.rstrip().endswith("hand-written")
