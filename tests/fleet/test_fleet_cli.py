"""`kvlab fleet` on the command line: JSON out, figures, one-line errors (exit 2)."""

import json

import pytest

from kvlab.cli import main


def test_fleet_json_and_figures(tmp_path, capsys):
    code = main(["fleet", "smollm2-135m", "--gpu", "l4", "--rate", "20", "--num-requests", "300", "--prompt-len",
                 "uniform:256:0.5", "--output-len", "32", "--prefix-fraction", "0.5", "--prefix-len", "64",
                 "--slo", "ttft:500", "tpot:50", "--price-per-card-hour", "0.8", "--price-per-mtok", "0.2",
                 "--json", "--plot", str(tmp_path), "--sweep-rates", "10,40", "--replicas", "2"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    r = data["result"]
    assert r["completed"] == 300 and r["replicas"] == 2 and r["cards"] == 2
    assert r["simulator"] == "engine"  # a small run goes through the engine's own scheduler
    assert set(r["ttft_ms"]) == {"mean", "p50", "p95", "p99"} and r["prefix_cache_hit_rate"] > 0
    assert {"dedicated_per_mtok", "break_even_rate", "cheaper"} <= set(r["cost"])
    assert [row["rate"] for row in data["sweep"]] == [10.0, 40.0]
    assert sorted(p.split("/")[-1] for p in data["figures"]) == ["smollm2-135m-kv-usage.png",
                                                                 "smollm2-135m-latency-vs-rate.png"]
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in data["figures"])
    assert "bandwidth" in data["efficiency_sources"]


def test_find_min_cards(capsys):
    argv = ["fleet", "smollm2-135m", "--gpu", "l4", "--rate", "150", "--num-requests", "1500", "--prompt-len",
            "512", "--output-len", "64", "--max-num-seqs", "16", "--slo", "ttft:1000", "tpot:40", "--json",
            "--simulator", "fast"]
    assert main(argv + ["--find-min-cards"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["min_cards"]
    assert data["result"]["meets_slo"] and best["cards"] == data["result"]["cards"] > 1
    tp = data["replica"]["cards"]
    assert main(argv + ["--replicas", str(best["replicas"] - 1), "--tensor-parallel-size", str(tp)]) == 0
    assert not json.loads(capsys.readouterr().out)["result"]["meets_slo"]  # one replica fewer misses it


def test_rich_summary(capsys):
    assert main(["fleet", "llama-3-8b", "--gpu", "h100", "--rate", "5", "--num-requests", "50",
                 "--kv-cache-dtype", "fp8", "--slo", "ttft:2000", "--price-per-card-hour", "2"]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50/p95/p99 ms" in out and "per million output tokens" in out


@pytest.mark.parametrize("argv,message", [
    (["fleet", "llama-3-8b", "--gpu", "h1000", "--rate", "1"], "unknown GPU"),
    (["fleet", "llama-3-8b", "--rate", "1"], "give --gpu"),
    (["fleet", "llama-3-8b", "--gpu", "h100", "--find-min-cards", "--num-requests", "5"], "needs --slo"),
    (["fleet", "llama-3-8b", "--gpu", "h100", "--prompt-len", "uniform:5:3"], "cannot read length"),
    (["fleet", "calibrate"], "needs a MODEL"),
    (["fleet", "llama-3-8b", "--gpu", "h100", "--calibration", "/nonexistent.json"], "cannot read --calibration"),
    (["fleet", "llama-3-8b", "--gpu", "h100", "--prefix-fraction", "2"], "--prefix-fraction"),
])
def test_mistakes_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, expected", [([], None), (["--block-size", "16"], 16)])
def test_calibrate_times_the_engine_at_kvlab_serves_block_size_unless_told(tmp_path, capsys, flag, expected):
    """The calibration's engine is kvlab serve's (its default block); a planned replica keeps vLLM's 16."""
    from needs import STORIES, require_file

    from kvlab.cache.pool import DEFAULT_BLOCK_SIZE
    require_file(STORIES, "stories260K")
    out = tmp_path / "cal.json"
    assert main(["fleet", "calibrate", str(STORIES), "--kv-cache-memory", "4MiB", "--batches", "1,2", "--contexts",
                 "16,32", "--chunks", "8,16", "--decode-steps", "2", "--output", str(out), *flag]) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["block_size"] == (expected or DEFAULT_BLOCK_SIZE) and DEFAULT_BLOCK_SIZE != 16
