"""`kvlab calibrate-kv`: the file it writes, several --data texts sharing the windows, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from needs import SHAKESPEARE, STORIES, require_file
from kvlab.cli import main
from kvlab.evals.calibrate import calibration_ids
from kvlab.evals.setting import EvalError


def test_windows_are_shared_out_in_order_and_never_straddle_two_texts() -> None:
    a, b = list(range(100)), list(range(1000, 1100))
    assert calibration_ids({"a": a, "b": b}, 10, 3) == a[:20] + b[:10]  # a gets the odd window
    assert calibration_ids({"a": a}, 10, 3) == a[:30]
    with pytest.raises(EvalError, match="fewer than the 2 calibration texts"):
        calibration_ids({"a": a, "b": b}, 10, 1)
    with pytest.raises(EvalError, match="b has 100 tokens, fewer than its 2 x 60"):
        calibration_ids({"a": a * 2, "b": b}, 60, 4)


def test_cli_writes_a_calibration_from_one_or_several_texts(tmp_path, capsys) -> None:
    require_file(STORIES, "stories260K")
    require_file(SHAKESPEARE, "tinyshakespeare")
    from kvlab.cache.kvquant_calibration import load_calibration
    other = tmp_path / "story.txt"
    other.write_text("Once upon a time there was a little dog who liked to run in the park. " * 60)
    base = ["calibrate-kv", str(STORIES), "--context", "64", "--windows", "2", "--no-sensitivity", "--json"]
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    assert main(base + ["--data", str(SHAKESPEARE), "-o", str(one)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["path"] == str(one) and summary["data"] == SHAKESPEARE.name and summary["bits"] == [3, 4]
    assert main(base + ["--data", str(SHAKESPEARE), "--data", str(other), "-o", str(two)]) == 0
    assert json.loads(capsys.readouterr().out)["data"] == f"{SHAKESPEARE.name}, story.txt"
    first, mixed = load_calibration(one), load_calibration(two)
    assert first.meta["windows"] == mixed.meta["windows"] == 2
    # the second window now comes from the story, so the key ranges move
    assert not torch.equal(first.layers[0].k_range, mixed.layers[0].k_range)


def test_cli_mistakes_are_one_line_errors(tmp_path, capsys) -> None:
    require_file(STORIES, "stories260K")
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8 \xc3\x28")
    for data in (tmp_path / "missing.txt", short, bad):
        assert main(["calibrate-kv", str(STORIES), "--data", str(data), "-o", str(tmp_path / "c.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 3 and "Traceback" not in err, err
    assert not (tmp_path / "c.safetensors").exists()
