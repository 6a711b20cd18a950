"""`kvlab bench decode` on stories260K: the grid, the same-run ratios and the roofline fractions, exactly."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvlab.bench.decode_sweep import Point, best_of, grid
from kvlab.cli import main
from needs import STORIES, require_file


def test_the_default_grid_is_a_cross_and_full_is_every_pair():
    assert grid([1, 4, 8], [128, 512], full=False) == [Point(1, 128), Point(4, 128), Point(8, 128), Point(1, 512)]
    assert grid([1, 4], [64, 32], full=True) == [Point(1, 64), Point(4, 64), Point(1, 32), Point(4, 32)]


def test_best_of_keeps_each_phases_fastest_round_and_every_round():
    runs = [{"prefill_s": 2.0, "decode_s": 1.0, "decode_steps": 3, "decode_path": "x"},
            {"prefill_s": 1.0, "decode_s": 4.0, "decode_steps": 3, "decode_path": "x"}]
    best = best_of(runs, batch=2, context=10, new_tokens=4)
    assert (best["prefill_s"], best["decode_s"]) == (1.0, 1.0) and best["decode_path"] == "x"
    assert best["prefill_tokens_per_s"] == 20.0 and best["decode_tokens_per_s"] == 6.0
    assert best["rounds"] == [{"prefill_s": 2.0, "decode_s": 1.0}, {"prefill_s": 1.0, "decode_s": 4.0}]


def test_decode_sweep_interleaves_engines_and_states_ratios_and_roofline(tmp_path, capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    import torch

    from kvlab.checkpoints.resolve import load_model
    from kvlab.commands.measure_cmd import weight_bytes_read
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
    from kvlab.plan.roofline import decode_step

    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", str(STORIES), "--batch-sizes", "1,3", "--contexts", "8,24", "--new-tokens", "4",
               "--threads", "1", "--bandwidth-gbs", "12.5", "--rounds", "2", "--json", str(out)])
    assert rc == 0 and "kvlab bench decode" in capsys.readouterr().out
    result = json.loads(out.read_text())
    expected = ["kvlab", "transformers (bfloat16)"] + (["llama.cpp"] if importlib.util.find_spec("llama_cpp") else [])
    assert result["engines"] == expected and result["bandwidth_gbs"] == 12.5
    assert [(p["batch"], p["context"]) for p in result["points"]] == [(1, 8), (3, 8), (1, 24)]
    model = load_model(str(STORIES), torch.float32, "gguf").model
    spec = model.config.to_plan_spec()
    assert result["weight_bytes_read_per_step"] == weight_bytes_read(model)
    for point in result["points"]:
        context = point["context"] + 2
        kv = kv_bytes_per_sequence(spec, context, cache_formats("auto", model_dtype="fp32"))
        floor = decode_step(spec, weight_bytes_read(model), kv, point["batch"], context, 12.5, float("inf")).seconds
        assert point["roofline_decode_tokens_per_s"] == pytest.approx(point["batch"] / floor)
        ours = point["engines"]["kvlab"]
        assert ours["decode_steps"] == 3 and ours["decode_ratio_to_kvlab"] == 1.0
        assert all(len(engine["rounds"]) == 2 for engine in point["engines"].values())
        for engine in point["engines"].values():
            assert engine["prefill_tokens_per_s"] == pytest.approx(point["batch"] * point["context"] /
                                                                   engine["prefill_s"])
            assert engine["decode_tokens_per_s"] == pytest.approx(point["batch"] * 3 / engine["decode_s"])
            assert engine["decode_ratio_to_kvlab"] == pytest.approx(engine["decode_tokens_per_s"] /
                                                                    ours["decode_tokens_per_s"])
            assert engine["prefill_ratio_to_kvlab"] == pytest.approx(engine["prefill_tokens_per_s"] /
                                                                     ours["prefill_tokens_per_s"])
            assert engine["decode_roofline_fraction"] == pytest.approx(engine["decode_tokens_per_s"] /
                                                                       point["roofline_decode_tokens_per_s"])
    assert result["provenance"]["machine"]["torch_threads"] == 1


def test_a_context_beyond_the_model_is_one_line_exit_2(capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    assert main(["bench", "decode", str(STORIES), "--contexts", "100000", "--no-transformers",
                 "--no-llama-cpp"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's" in err and len(err.strip().splitlines()) == 1


def test_batch_1_race_is_decode_speeds_benchmark(tmp_path, capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    out = tmp_path / "race.json"
    assert main(["bench", "decode", str(STORIES), "--batch-1-race", "--no-transformers", "--new-tokens", "5",
                 "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "decode_speed" and result["new_tokens"] == 5 and result["repeats"] == 2
    assert all(len(run["seconds"]) == 2 and len(run["ids"]) == 5 for run in result["runs"])
    assert "tok/s (median)" in capsys.readouterr().out
