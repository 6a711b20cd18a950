"""Where a GGUF product runs: the crossover is measured once per machine and shape, remembered, and overridable."""

import numpy as np
import pytest
import torch

from kvlab.nn import matmul_backend as mb
from kvlab.nn.ggml import GGMLLinear
from needs import require_kernels
from test_ggml import random_planes


@pytest.fixture
def layer():
    require_kernels()
    return GGMLLinear(random_planes("q4_1", 64, 128, np.random.default_rng(3)))


def test_the_crossover_is_measured_once_remembered_and_read_back(layer, tmp_path, monkeypatch):
    monkeypatch.setattr(mb, "_MEASURED", {})
    calls = []
    monkeypatch.setattr(mb, "measure", lambda l: calls.append(l) or {"crossover": 16, "seconds": {}})
    path = tmp_path / "crossover.json"
    assert mb.crossover(layer, path) == 16 and mb.crossover(layer, path) == 16 and len(calls) == 1
    monkeypatch.setattr(mb, "_MEASURED", {})  # a new process reads the file
    assert mb.crossover(layer, path) == 16 and len(calls) == 1
    assert list(mb.known_crossovers(path).values()) == [16]


def test_the_setting_decides_before_the_crossover(layer, monkeypatch):
    monkeypatch.setattr(mb, "crossover", lambda l, cache_file=None: 32)
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "auto")
    assert [mb.uses_library(layer, r) for r in (1, 16, 32, 64)] == [False, False, True, True]
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "kernels")
    assert not mb.uses_library(layer, 512)
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "library")
    assert mb.uses_library(layer, 2) and not mb.uses_library(layer, 1)  # one row is a decode: always C
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "fast")
    with pytest.raises(ValueError, match="KVLAB_MATMUL_BACKEND"):
        mb.uses_library(layer, 64)


def test_a_measurement_times_both_backends_and_names_the_crossover(layer):
    figures = mb.measure(layer)
    assert set(figures["seconds"]) == {str(r) for r in mb.ROWS}
    assert all(len(pair) == 2 and min(pair) > 0 for pair in figures["seconds"].values())
    assert figures["crossover"] in (*mb.ROWS, mb.NEVER)


def test_the_library_copy_is_bf16_only_where_the_cpu_multiplies_it(monkeypatch):
    monkeypatch.setattr(mb, "_cpu_flags", lambda: {"avx2", "fma"})
    assert mb.library_dtype() == torch.float32
    monkeypatch.setattr(mb, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert mb.library_dtype() == torch.bfloat16
