"""reports/conversions: the steps' order, the cells a server cannot fill say why, and the README renders from
results.json alone (a synthetic one here; the real run is `kvlab bench conversions`)."""

import json

import torch

from kvlab.checkpoints.hf import save_hf
from kvlab.checkpoints.mla_aware import convert_to_mla_aware
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.bench import conversions, conversions_speed
from kvlab.report.conversions import render


def test_steps_convert_then_measure_then_train_then_serve():
    keys = [key for key, _ in conversions.steps()]
    assert len(keys) == len(set(keys))
    order = [key.split(":")[0] for key in keys]
    assert order.index("convert") < order.index("quality") < order.index("uptrain") < order.index("serving")
    assert order[-1] == "speed" and "pad:mla50:uptrained" in keys and "pad:mqa:converted" not in keys
    # the comparisons are measured before training only, and only the DeepSeek layout is padded for vLLM
    assert "quality:mqa-mean:converted" in keys and "uptrain:mqa-mean" not in keys
    assert "quality:mla50-kvlab:converted" in keys and not any(k.startswith("pad:mla50-kvlab") for k in keys)
    assert keys.index("quality:mqa:converted") < keys.index("uptrain:mqa") < keys.index("quality:mqa:uptrained")


def mla_dir(tmp_path):
    torch.manual_seed(0)
    source = Decoder(ModelConfig(vocab_size=60, dim=48, n_layers=1, n_heads=6, n_kv_heads=2, max_seq_len=64)).eval()
    model = convert_to_mla_aware(source, 12, 8, torch.randint(0, 60, (4, 16))).model
    save_hf(model, str(tmp_path))
    return str(tmp_path)


def test_kvlab_serves_an_mla_directory_and_vllm_says_why_not_with_fp8(tmp_path):
    path = mla_dir(tmp_path)
    engine = conversions.engine_line(path)
    assert engine["served"] and engine["lines"][-1].startswith("CPU KV cache size: ")
    for kv in ("auto", "fp8"):
        assert not isinstance(conversions_speed.peer("kvlab", path, kv, 8000), str)
    assert "model's dtype" in conversions_speed.peer("vllm", path, "fp8", 8000) or "no vLLM venv" in \
        conversions_speed.peer("vllm", path, "fp8", 8000)


def test_the_readme_renders_every_kind_of_cell():
    quality = {"perplexity": 28.0, "per_window": [30.0, 26.0], "passkey": [24, 24], "passkey_length": 2048}
    worse = {**quality, "perplexity": 42.0, "passkey": [20, 24]}
    plan = {"log_lines": ["Available KV cache memory: 1.00 GiB", "CPU KV cache size: 46,592 tokens"], "tokens": 46592}
    up = {"tokens": 240000, "train_seconds": 3000.0, "tokens_per_s": 80.0,
          "time_split": {"teacher": 0.3, "student": 0.69, "optimizer": 0.01},
          "record": [{"tokens": 1024 * k, "val_kl": 1.0 / k} for k in range(1, 9)]}
    steps = {
        "convert:mqa": {"command": "kvlab convert smollm2-135m --kv-heads 1 -o mqa",
                        "report": {"kv_bytes_per_token_fp16_before": 23040, "kv_bytes_per_token_fp16_after": 7680}},
        "quality:original:converted": quality, "quality:mqa:converted": worse, "quality:mqa:uptrained": dict(quality),
        "uptrain:mqa": {"command": "kvlab uptrain mqa-up ...", "report": up},
        "serving:mqa:uptrained": {"plan": plan, "capacity_matches_plan": True, "text_matches": {"completion": True},
                                  "vllm": {"started": True, "capacity_line": "CPU KV cache size: 46,592 tokens"},
                                  "kvlab_engine": {"served": False, "why": "not yet"}},
        "speed:kvlab:mla50:auto": {"served": False, "why": "kvlab serve runs no MLA model yet"},
        "speed:vllm:mqa:auto": {"served": True, "cells": {"in128-c1": {
            "median_ttft_ms": 120.0, "median_itl_ms": 40.0, "output_throughput": 20.5, "completed": 4}}},
    }
    text = render({"steps": steps}, conversions.VARIANTS, [key for key, _ in conversions.steps()])
    assert "| MQA (1 KV head), aligned | `kvlab convert smollm2-135m --kv-heads 1 -o mqa` | 7680 | 33% | 42.00 (+50.0%) " \
           "| 20/24 | 28.00 (+0.0%) | 24/24 | 240,000 tokens, 50 min |" in text
    assert "not served: kvlab serve runs no MLA model yet" in text and "120 / 40 / 20.5" in text
    assert "not served: not yet" in text and "completion: yes" in text
    assert json.dumps(steps)  # results.json is plain JSON


def test_a_conversion_records_the_command_a_user_types(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_REPORT_WORK", str(tmp_path))
    (tmp_path / "mqa").mkdir()
    (tmp_path / "mqa" / "config.json").write_text("{}")  # converted before: reused, not redone
    step = conversions.convert(conversions.VARIANTS[1])
    assert step["command"] == "kvlab convert smollm2-135m --kv-heads 1 -o mqa"


def test_an_unfinished_uptraining_is_not_measured_as_uptrained(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(conversions, "OUT", tmp_path)
    monkeypatch.setattr(conversions, "quality", lambda v, stage: measured.append((v.name, stage)) or {"ok": 1})
    conversions.run(60, only="quality:mqa:uptrained")
    assert measured == []
    conversions.Results(tmp_path / "results.json").put("uptrain:mqa", {"report": {}})
    conversions.run(60, only="quality:mqa:uptrained")
    assert measured == [("mqa", "uptrained")]


def test_a_speed_cell_predicted_past_the_budget_is_skipped_with_the_larger_ones(monkeypatch):
    """Real vLLM on 2 AVX2 cores took 225 s for four 1,024-token requests: 8 would take 450 s (run), 32 about
    1,800 s (skipped, and 64 after it); the 128-token row runs whole."""
    from kvlab.bench import peers, vllm_interop

    clock, seconds = [0.0], {128: 10.0, 1024: 225.0}

    class Running:
        def __init__(self, start, port):
            self.base_url, self.startup_s = f"http://127.0.0.1:{port}", 1.0

        def stop(self):
            pass

    def bench(python, url, model, path, flags, requests, rate, concurrency, workdir):
        length = int(flags[flags.index("--random-input-len") + 1])
        clock[0] += seconds[length] * requests / 4
        return {"median_ttft_ms": 1.0, "median_itl_ms": 1.0, "output_throughput": 1.0, "completed": requests}

    monkeypatch.setattr(conversions_speed, "peer", lambda *a: object())
    monkeypatch.setattr(peers, "Running", Running)
    monkeypatch.setattr(peers, "free_ports", lambda n: [8000])
    monkeypatch.setattr(vllm_interop, "run_vllm_bench", bench)
    monkeypatch.setattr(vllm_interop, "reset_prefix_cache", lambda url: None)
    monkeypatch.setattr(conversions_speed.time, "monotonic", lambda: clock[0])
    grid = conversions_speed.run_grid("vllm", "DIR", "auto", (1, 4, 16, 32), (128, 1024), 64)
    cells = grid["cells"]
    assert all(cells[f"in128-c{c}"]["completed"] == max(4, 2 * c) for c in (1, 4, 16, 32))
    assert cells["in1024-c4"]["seconds"] == 450.0
    assert cells["in1024-c16"] == {"skipped": "predicted 1800 s (over 600 s)"} and "skipped" in cells["in1024-c32"]
    assert "skipped" in render({"steps": {"speed:vllm:original:auto": grid}}, conversions.VARIANTS, [])
