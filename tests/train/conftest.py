"""A small synthetic corpus, and Tiny Shakespeare from ../shared when present."""

import random
from pathlib import Path

import pytest

from needs import SHAKESPEARE, require_file


@pytest.fixture
def text_file(tmp_path) -> Path:
    rng = random.Random(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "\n"]
    path = tmp_path / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(3000)), encoding="utf-8")
    return path


@pytest.fixture
def shakespeare() -> Path:
    return require_file(SHAKESPEARE, "../shared/data/tinyshakespeare.txt")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run steadier on one thread when other jobs share the machine's two cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
