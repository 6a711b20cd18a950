"""kvlab eval's mechanics on stories260K: perplexity through the cache, passkey prompts, resuming."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from needs import SHAKESPEARE, STORIES, require_file
from kvlab.cli import main
from kvlab.evals.passkey import build_prompt, run_cell, trial_key
from kvlab.evals.perplexity import perplexity, window_nll
from kvlab.evals.runner import Evaluator, PasskeyTask, PerplexityTask
from kvlab.evals.setting import EvalError, KVSetting, build_model, new_cache
from kvlab.evals.store import ResultStore


@pytest.fixture(scope="module")
def loaded():
    require_file(STORIES, "stories260K")
    require_file(SHAKESPEARE, "tinyshakespeare")
    from kvlab.checkpoints.resolve import load_model
    return load_model(str(STORIES), torch.float32, "dense")


def text_ids(loaded, n: int) -> list[int]:
    return loaded.tokenizer.encode(SHAKESPEARE.read_text()[:4 * n], add_bos=True)[:n]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_perplexity_through_an_exact_cache_equals_one_full_pass(loaded, chunk: int) -> None:
    model, ids = loaded.model.eval(), text_ids(loaded, 65)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    full = float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
    total, count = window_nll(model, ids, model.new_cache(1, len(ids), "fp32"), chunk)
    assert count == len(ids) - 1 and total == pytest.approx(full, rel=1e-5)


def test_a_quantised_cache_changes_the_loss_and_a_window_is_exact_under_chunking(loaded) -> None:
    model, ids = loaded.model.eval(), text_ids(loaded, 100)
    exact = perplexity(model, [ids], lambda n: model.new_cache(1, n, "fp32"), 50)["perplexity"]
    int2 = perplexity(model, [ids], lambda n: model.new_cache(1, n, "int2"), 50)["perplexity"]
    assert int2 > exact * 1.05  # 2-bit rows read back through the cache cost loss
    setting = KVSetting("fp32", window=24, sinks=4)
    by_chunk = [perplexity(model, [ids], lambda n: new_cache(model, setting, n), c)["perplexity"] for c in (1, 16, 60)]
    assert by_chunk[1] == pytest.approx(by_chunk[0], rel=1e-5) and by_chunk[2] == pytest.approx(by_chunk[0], rel=1e-5)
    wide = KVSetting("fp32", window=500, sinks=0)  # a window wider than the text: full attention
    assert perplexity(model, [ids], lambda n: new_cache(model, wide, n), 16)["perplexity"] == pytest.approx(exact, rel=1e-5)


def test_passkey_prompt_places_the_key_and_keys_are_paired(loaded) -> None:
    tok = loaded.tokenizer
    prompt = build_prompt(tok, 1500, 0.5, "12345")
    assert abs(prompt.length - 1500) < 100  # within one filler sentence
    assert "12345" in tok.decode(prompt.suffix) and "12345" not in tok.decode(prompt.prefix)
    assert 0.35 < len(prompt.prefix) / prompt.length < 0.65
    assert trial_key(0, 1500, 0.5, 3) == trial_key(0, 1500, 0.5, 3) != trial_key(0, 1500, 0.5, 4)
    with pytest.raises(EvalError):
        build_prompt(tok, 50, 0.5, "12345")


def test_passkey_cell_shares_its_prefix_but_not_its_cache(loaded) -> None:
    model = loaded.model.eval()
    cell = run_cell(model, loaded.tokenizer, lambda n: model.new_cache(1, n, "fp32"), 400, 0.5, 2, 0, 64)
    assert cell["trials"] == 2 and len(cell["answers"]) == 2
    assert len({a["key"] for a in cell["answers"]}) == 2
    assert cell["correct"] == sum(a["correct"] for a in cell["answers"])


def test_results_resume_and_skip_finished_cells(loaded, tmp_path, monkeypatch) -> None:
    out = tmp_path / "eval.json"
    task = PerplexityTask(SHAKESPEARE, context=64, windows=2, chunk=32, offset=0)
    keys = PasskeyTask(lengths=(400,), depths=(0.2, 0.8), trials=1, chunk=128)
    setting = KVSetting("int8")
    first = Evaluator(loaded, ResultStore(out, {"model": "stories"}))
    first.perplexity(setting, task)
    first.passkey(setting, keys)
    saved = json.loads(out.read_text())
    assert len(saved["cells"]) == 3
    calls = []
    import kvlab.evals.runner as runner
    monkeypatch.setattr(runner, "run_cell", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(runner, "perplexity", lambda *a, **k: calls.append(a))
    again = Evaluator(loaded, ResultStore(out, {"model": "stories"}))
    assert again.pending(setting, task) == 0 and again.pending(setting, keys) == 0
    assert again.perplexity(setting, task) == saved["cells"][task.key(setting)]
    again.passkey(setting, keys)
    assert calls == []
    with pytest.raises(EvalError):
        ResultStore(out, {"model": "another"})
    with pytest.raises(EvalError, match="on dense weights, not gguf-a8"):  # never a dense cell for an int8 run
        ResultStore(out, {"model": "stories", "weights": "gguf-a8"})
    assert ResultStore(out, {"model": "stories", "weights": "dense"}).has(task.key(setting))  # older: dense


def test_kv_head_conversion_settings_change_the_model(loaded) -> None:
    one = build_model(loaded, KVSetting(kv_heads=1, method="first"))
    assert one.config.kv_heads == 1 and loaded.model.config.kv_heads == 4
    assert KVSetting("int4", pre_rope=True, kv_heads=2, method="random").label == "int4+prerope kvh2-random"


def test_mla_settings_convert_the_model_and_cache_its_latent(loaded) -> None:
    setting = KVSetting("fp16", mla_rank=16, mla_rope=4)
    assert setting.label == "fp16 mla-r16-rope4"
    mla = build_model(loaded, setting)
    assert mla.config.attention == "mla" and mla.config.kv_lora_rank == 16
    assert loaded.model.config.attention == "gqa"  # converted in memory: the loaded model is untouched
    cache = new_cache(mla, setting, 8)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        mla(ids, cache)
    assert cache.seq_len(0) == 4
    with pytest.raises(EvalError):
        KVSetting("fp16", kv_heads=1, mla_rank=16)


def test_cli_resumes_and_reports_mistakes_in_one_line(tmp_path, capsys) -> None:
    require_file(STORIES, "stories260K")
    out = tmp_path / "e.json"
    argv = ["eval", str(STORIES), "--task", "perplexity", "--text", str(SHAKESPEARE), "--context", "64",
            "--offset", "0", "--chunk", "32", "--kv-cache-dtype", "int4", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    line = capsys.readouterr().out
    assert main(argv + ["--json"]) == 0
    cell = json.loads(capsys.readouterr().out)["cells"][0]
    assert math.isfinite(cell["perplexity"]) and f"{cell['perplexity']:.3f}" in line
    assert len(json.loads(out.read_text())["runs"]) == 2  # both runs' provenance, one cell
    assert main(["eval", str(STORIES), "--sink-tokens", "4", "--no-progress"]) == 2
    assert main(["eval", str(STORIES), "--kv-cache-dtype", "kvquant3", "--kv-calibration", str(tmp_path / "no"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err


def test_kvquant_on_a_real_model_calibrates_holds_the_planned_bytes_and_tracks_fp32(loaded, tmp_path) -> None:
    from kvlab.cache.kvquant_calibration import load_calibration, save_calibration
    from kvlab.evals.calibrate import calibrate
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_fixed_bytes

    model = loaded.model.eval()
    ids = text_ids(loaded, 600)
    before = model.embed.weight.requires_grad
    weighted = calibrate(model, ids, context=128, windows=2, sensitivity=True)
    plain = calibrate(model, ids, context=128, windows=2, sensitivity=False)
    assert not torch.equal(weighted.layers[0].v_codebooks[3], plain.layers[0].v_codebooks[3])
    # calibration leaves the model as it found it: same flags, no gradients left behind
    assert model.embed.weight.requires_grad == before and all(p.grad is None for p in model.parameters())
    save_calibration(weighted, tmp_path / "c.safetensors")
    cal = load_calibration(tmp_path / "c.safetensors", model.config)
    spec, held = model.config.to_plan_spec(), ids[300:400]
    results = {}
    for dtype in ("fp32", "kvquant4", "kvquant3"):
        setting = KVSetting(dtype)
        caches = []
        results[dtype] = perplexity(model, [held], lambda n: caches.append(new_cache(model, setting, n, cal))
                                    or caches[-1], 32)["perplexity"]
        if dtype != "fp32":
            formats = cache_formats(dtype)
            planned = kv_bytes_per_sequence(spec, len(held) - 1, formats) + kv_fixed_bytes(spec, formats)
            assert caches[0].nbytes() == planned
    assert results["kvquant4"] < results["fp32"] * 1.10 and results["kvquant3"] < results["fp32"] * 1.25


def test_cli_refuses_a_text_that_is_not_utf8_in_one_line(tmp_path, capsys) -> None:
    require_file(STORIES, "stories260K")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8 \xc3\x28")
    assert main(["eval", str(STORIES), "--task", "perplexity", "--text", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not UTF-8" in err and "Traceback" not in err
