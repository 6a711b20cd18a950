"""Corrupt or truncated model files given to `kvlab serve`: exit 2 with one line naming the file, never a traceback."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from kvlab.cli import main
from needs import STORIES, require_file
from server_helpers import free_port


def gguf_cases(tmp_path) -> dict[str, str]:
    data = STORIES.read_bytes()
    cases = {"empty.gguf": b"", "noise.gguf": os.urandom(4096), "header-only.gguf": data[:1000],
             "half.gguf": data[:len(data) // 2], "all-but-a-byte.gguf": data[:-1],
             "bad-magic.gguf": b"GGUX" + data[4:]}
    out = {}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        out[name] = str(tmp_path / name)
    return out


def hf_cases(tmp_path) -> dict[str, str]:
    good = {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
            "hidden_size": 64, "num_hidden_layers": 5, "intermediate_size": 172}
    configs = {"not-json": "{\"model_type\": \"llama\",", "a-list": "[1, 2]", "empty": "",
               "missing-fields": json.dumps({"model_type": "llama"}),
               "wrong-types": json.dumps({**good, "hidden_size": "64"}),
               "bad-weights": json.dumps(good), "not-utf8": b"\xff\xfe{}"}
    out = {}
    for name, config in configs.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
        empty_safetensors = struct.pack("<Q", 8) + b"{}      "  # a valid file holding no tensor
        (d / "model.safetensors").write_bytes(os.urandom(64) if name == "bad-weights" else empty_safetensors)
        out[name] = str(d)
    return out


@pytest.fixture
def stories():
    return require_file(STORIES, "../shared/models/stories260K.gguf")


def one_line_exit_2(capsys, path: str) -> str:
    rc = main(["serve", path, "--port", str(free_port())])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("kvlab serve: error:"), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_corrupt_gguf_files(stories, tmp_path, capsys):
    for name, path in gguf_cases(tmp_path).items():
        assert name in one_line_exit_2(capsys, path)


def test_corrupt_config_json_directories(tmp_path, capsys):
    for name, path in hf_cases(tmp_path).items():
        assert name in one_line_exit_2(capsys, path)


def test_the_real_process_exits_2_on_a_truncated_gguf(stories, tmp_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(STORIES.read_bytes()[:600_000])
    done = subprocess.run([sys.executable, "-m", "kvlab.cli", "serve", str(path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "truncated.gguf" in done.stderr and "Traceback" not in done.stderr
