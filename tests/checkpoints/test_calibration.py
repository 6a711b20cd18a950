"""Calibration text (kvlab.checkpoints.calibration): windows of the first tokens, one-line errors, and the
real-models report's calibration and evaluation texts sharing no passage."""

import pytest
import torch

from needs import STORIES, require_file, require_smollm2
from kvlab.checkpoints.calibration import disjoint, load_calibration
from kvlab.plan.errors import PlanError


@pytest.fixture(scope="module")
def stories_tokenizer():
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(str(require_file(STORIES, "../shared/models/stories260K.gguf"))).tokenizer


def test_windows_are_the_first_tokens_in_order(stories_tokenizer, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little girl named Lily. " * 40)
    calibration = load_calibration(stories_tokenizer, text, tokens=100, window=30)
    ids = stories_tokenizer.encode(text.read_text(), add_bos=False)
    assert calibration.windows.shape == (3, 30) and calibration.tokens == 90
    assert torch.equal(calibration.windows.reshape(-1), torch.tensor(ids[:90]))
    assert calibration.describe()["text"] == str(text) and len(calibration.sha256) == 64


def test_bad_calibration_input_is_one_line(stories_tokenizer, tmp_path):
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    for path, match in ((tmp_path / "missing.txt", "cannot read"), (binary, "not UTF-8")):
        with pytest.raises(PlanError, match=match):
            load_calibration(stories_tokenizer, path)
    with pytest.raises(PlanError, match="tokenizer"):
        load_calibration(None, binary)
    with pytest.raises(PlanError, match="must be positive"):
        load_calibration(stories_tokenizer, binary, tokens=0)


def test_disjoint_finds_a_shared_passage():
    a = list(range(100))
    assert disjoint(a, list(range(200, 300)), span=8)
    assert not disjoint(a, [500] * 5 + list(range(40, 60)), span=8)


def test_the_report_calibrates_on_a_text_that_shares_nothing_with_its_evaluation_text():
    """The default calibration (the first 16,384 tokens of Pride and Prejudice) and the real-models report's
    perplexity windows of Frankenstein share no 32-token passage."""
    require_smollm2()
    from kvlab.checkpoints.calibration import default_text
    from kvlab.checkpoints.resolve import load_checkpoint
    from kvlab.evals.calibrate import text_ids
    from kvlab.bench.real_models import shared_file
    from kvlab.bench.real_models_study import CONTEXT, EVAL_TEXT, OFFSET, WINDOWS

    tokenizer = load_checkpoint("smollm2-135m").tokenizer
    calibration = load_calibration(tokenizer, default_text())
    evaluated = text_ids(tokenizer, shared_file("data", "english", EVAL_TEXT))[OFFSET:OFFSET + CONTEXT * WINDOWS]
    assert calibration.tokens == 16384 and "pride" in calibration.source
    assert disjoint(calibration.windows.reshape(-1).tolist(), evaluated)
