"""`kvlab generate` and `kvlab measure` end to end through kvlab.cli.main, on stories260K."""

import json
import os

import pytest

from kvlab.cli import main

from needs import STORIES as STORIES_PATH, require_file

STORIES = str(STORIES_PATH)


@pytest.fixture(autouse=True)
def stories_present():
    require_file(STORIES_PATH, "../shared/models/stories260K.gguf")


def test_generate_streams_the_known_story(capsys):
    code = main(["generate", STORIES, "--prompt", "Once upon a time", "--max-tokens", "20", "--temperature", "0",
                 "--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith("Once upon a time, there was a little girl named Lily.")
    assert "tok/s decode" in err


def test_generate_by_name_from_bos_with_sampling_is_seeded(capsys, monkeypatch):
    monkeypatch.setenv("KVLAB_SHARED", os.path.join(os.path.dirname(STORIES), ".."))
    runs = []
    for _ in range(2):
        assert main(["generate", "stories260k", "--max-tokens", "12", "--temperature", "0.9", "--seed", "7",
                     "--threads", "1"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and len(runs[0].strip()) > 10


@pytest.mark.parametrize("kv_dtype,kv_heads", [("auto", None), ("int8", None), ("kivi2", None), ("fp8", 2),
                                               ("int4", 1)])
def test_measure_json_bytes_equal_the_plan(capsys, kv_dtype, kv_heads):
    argv = ["measure", STORIES, "--kv-cache-dtype", kv_dtype, "--prompt-len", "40", "--new-tokens", "9",
            "--batch", "2", "--bandwidth-gbs", "30", "--json", "--threads", "1"]
    if kv_heads:
        argv += ["--kv-heads", str(kv_heads)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kv_bytes_measured"] == result["kv_bytes_planned"] > 0
    assert result["tokens_cached"] == 48 and result["config"]["kv_heads"] == (kv_heads or 4)
    # The roofline is bandwidth-bound arithmetic on the figures beside it: weights (every matrix but
    # the embedding table, read once a step) plus each sequence's cache at the mean context, 40 + 9 // 2.
    # stories260K in fp32: 292,800 parameters less the 512 x 64 embedding, less the K and V rows
    # (8 channels x 64 inputs each, 5 layers) of the KV heads a conversion pooled away.
    heads = kv_heads or 4
    assert result["weight_bytes_read_per_step"] == 4 * (292_800 - 512 * 64 - 5 * 2 * (4 - heads) * 8 * 64)
    if kv_dtype == "auto":
        assert result["kv_bytes_read_per_sequence"] == 44 * 5 * heads * 8 * 2 * 4
    step_bytes = result["weight_bytes_read_per_step"] + 2 * result["kv_bytes_read_per_sequence"]
    assert result["roofline_decode_tokens_per_s"] == pytest.approx(2 * 30e9 / step_bytes)
    assert result["roofline_fraction"] == pytest.approx(result["decode_tokens_per_s"]
                                                        / result["roofline_decode_tokens_per_s"])
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):  # a tiny model: hundreds to millions
        assert 10 < result[key] < 1e8, key
    assert result["provenance"]["torch_version"] and result["provenance"]["kvlab_version"]


def test_measure_table(capsys):
    assert main(["measure", STORIES, "--prompt-len", "8", "--new-tokens", "4", "--bandwidth-gbs", "30",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "KV cache bytes (fp32) equal" in out and "decode tokens/s" in out


@pytest.mark.parametrize("argv,message", [
    (["generate", "no-such-model", "--max-tokens", "3"], "unknown model 'no-such-model'"),
    (["generate", STORIES, "--max-tokens", "5000"], "exceeds the model's"),
    (["measure", STORIES, "--kv-heads", "3"], "divide the 8 query heads"),
    (["measure", STORIES, "--kv-cache-dtype", "int4", "--kv-heads", "2", "--weights", "int4"], "no longer 4-bit"),
    (["generate", STORIES, "--max-tokens", "-2"], "positive integer"),
    (["generate", STORIES, "--chat", "--prompt", "hi"], "no chat template"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    try:
        code = main(argv + ["--threads", "1"])
    except SystemExit as exit_:  # argparse's own errors exit from inside the parser
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def kvquant_file(tmp_path):
    """A KVQuant calibration for stories260K's shape (random activations: these tests check paths, not quality)."""
    from kvquant_helpers import random_calibration
    from kvlab.cache.kvquant_calibration import save_calibration
    from kvlab.checkpoints.resolve import load_checkpoint

    path = tmp_path / "stories.kvquant.safetensors"
    save_calibration(random_calibration(load_checkpoint(STORIES).model.config), path)
    return str(path)


@pytest.mark.parametrize("kv_dtype", ["kvquant4", "kvquant3"])
def test_generate_and_llm_give_the_same_greedy_tokens_on_a_kvquant_pool(capsys, kvquant_file, kv_dtype):
    """`kvlab generate --kv-cache-dtype kvquant4` and `LLM(..., kv_cache_dtype="kvquant4")` run one engine
    path over one pool format with one calibration: the same greedy text."""
    from kvlab import LLM, SamplingParams

    prompt = "Once upon a time"
    assert main(["generate", STORIES, "--prompt", prompt, "--max-tokens", "20", "--temperature", "0",
                 "--kv-cache-dtype", kv_dtype, "--kv-calibration", kvquant_file, "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert f"KV pool {kv_dtype}" in err and "module by module" in err
    llm = LLM(STORIES, kv_cache_dtype=kv_dtype, kv_calibration=kvquant_file, kv_cache_memory="4MiB")
    answer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    assert out.rstrip("\n") == prompt + answer


def test_measure_kvquant_bytes_equal_the_plan(capsys, kvquant_file):
    assert main(["measure", STORIES, "--kv-cache-dtype", "kvquant4", "--kv-calibration", kvquant_file,
                 "--prompt-len", "40", "--new-tokens", "9", "--batch", "2", "--bandwidth-gbs", "30", "--json",
                 "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kv_bytes_measured"] == result["kv_bytes_planned"] > 0


def test_kvquant_without_its_calibration_is_one_line_and_exit_2(capsys, tmp_path):
    """By default the calibration is the file `kvlab calibrate-kv` writes beside the model, as `kvlab eval` reads."""
    for extra, message in (([], "no KVQuant calibration at " + STORIES + ".kvquant.safetensors"),
                           (["--kv-calibration", str(tmp_path / "x.safetensors")], "no KVQuant calibration at")):
        code = main(["generate", STORIES, "--kv-cache-dtype", "kvquant4", "--max-tokens", "3", "--threads", "1",
                     *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
