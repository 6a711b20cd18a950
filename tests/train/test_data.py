"""Character data: the 90/10 split, deterministic batches, the verified download and its failures."""

import io
import urllib.error

import pytest
import torch

from kvlab.train import data
from kvlab.train.data import (DataError, fetch_tiny_shakespeare, load_corpus, tiled_windows, train_batch,
                              TINY_SHAKESPEARE_SHA256)


def test_split_is_first_90_percent_then_the_rest(text_file):
    corpus = load_corpus(text_file)
    text = text_file.read_text(encoding="utf-8")
    assert len(corpus.train) == int(len(text) * 0.9) and len(corpus.train) + len(corpus.val) == len(text)
    assert corpus.decode(torch.cat([corpus.train, corpus.val]).tolist()) == text
    assert corpus.chars == "".join(sorted(set(text)))
    assert corpus.encode(corpus.decode([3, 1, 2])) == [3, 1, 2]


def test_tiny_shakespeare_split_and_checksum(shakespeare):
    corpus = load_corpus(shakespeare)
    assert corpus.sha256 == TINY_SHAKESPEARE_SHA256
    assert corpus.vocab_size == 65 and (len(corpus.train), len(corpus.val)) == (1_003_854, 111_540)


def test_batches_are_a_function_of_seed_and_step(text_file):
    corpus = load_corpus(text_file)
    x1, y1 = train_batch(corpus, 0, 7, 4, 16)
    train_batch(corpus, 0, 3, 4, 16)  # other draws in between change nothing
    x2, y2 = train_batch(corpus, 0, 7, 4, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(x1, train_batch(corpus, 0, 8, 4, 16)[0])
    assert not torch.equal(x1, train_batch(corpus, 1, 7, 4, 16)[0])


def test_tiled_windows_cover_the_split_once(text_file):
    corpus = load_corpus(text_file)
    windows = list(tiled_windows(corpus.val, 10, 3))
    xs = torch.cat([x for x, _ in windows]).flatten()
    assert torch.equal(xs, corpus.val[: len(xs)]) and len(xs) == (len(corpus.val) - 1) // 10 * 10


def test_cached_copy_is_used_without_network(shakespeare, tmp_path, monkeypatch):
    target = tmp_path / "tinyshakespeare.txt"
    target.write_bytes(shakespeare.read_bytes())
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda *a, **k: pytest.fail("no download expected"))
    assert fetch_tiny_shakespeare(target) == target


def test_download_is_verified_then_cached(shakespeare, tmp_path, monkeypatch):
    payload = shakespeare.read_bytes()
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda *a, **k: io.BytesIO(payload))
    target = tmp_path / "cache" / "tinyshakespeare.txt"
    assert fetch_tiny_shakespeare(target).read_bytes() == payload
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda *a, **k: io.BytesIO(b"not shakespeare"))
    with pytest.raises(DataError, match="sha256"):
        fetch_tiny_shakespeare(tmp_path / "other.txt")
    assert not (tmp_path / "other.txt").exists()


def test_offline_without_a_copy_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from kvlab.cli import main

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    assert main(["study", "gqa", "--quick", "--work", str(tmp_path / "w"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be downloaded" in err and "--data" in err
