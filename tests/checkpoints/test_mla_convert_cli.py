"""`kvlab convert --to mla --layout kvlab` on stories260K (8 query heads, 4 KV heads of 8 channels).

At full rank the written DeepSeek-V2-format directory reproduces the source's logits; at a
reduced rank its measured cache bytes equal what `kvlab plan OUT` says; bad ranks are one line,
exit 2, nothing written; transformers' DeepseekV2 cannot load the extensions exactly, as the
README and the command's help say.
"""

import json
import os

import pytest
import torch

from needs import STORIES, require_file, require_module
from kvlab.cli import main

IDS = [1, 403, 407, 261, 378, 371, 296, 314, 260, 425, 1, 22, 85, 300, 301, 302]


@pytest.fixture(scope="module")
def stories_path():
    return str(require_file(STORIES, "../shared/models/stories260K.gguf"))


@pytest.fixture(scope="module")
def source(stories_path):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(stories_path).model


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def load(path):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(str(path)).model


def convert(stories_path, out, capsys, *flags):
    assert main(["convert", stories_path, "--to", "mla", "--layout", "kvlab", *flags, "-o", str(out), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_full_rank_reproduces_the_source_logits(stories_path, source, tmp_path, capsys):
    report = convert(stories_path, tmp_path / "full", capsys, "--kv-lora-rank", "full")
    assert (report["kv_lora_rank"], report["full_rank"], report["rope_dim"], report["rope_key_heads"]) == (32, 32, 8, 4)
    assert report["exact"] and report["kept_energy_min"] == pytest.approx(1.0, abs=1e-12)
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert (config["model_type"], config["kvlab_rope_key_heads"], config["kvlab_latent_norm"]) == ("deepseek_v2", 4, False)
    ours, theirs = logits(load(tmp_path / "full")), logits(source)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-5)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    # 4 KV heads x 8 channels = 32 = the full rank: as many bytes as the source, none saved
    assert report["kv_bytes_per_token_fp16_after"] == report["kv_bytes_per_token_fp16_before"] == 5 * 2 * 32 * 2


def test_reduced_rank_cache_bytes_equal_the_plan_of_the_written_config(stories_path, source, tmp_path, capsys):
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
    from kvlab.plan.loaders import load_model

    out = tmp_path / "r12"
    report = convert(stories_path, out, capsys, "--kv-lora-rank", "12", "--rope-dim", "4")
    assert not report["exact"] and 0.5 < report["kept_energy_min"] < 1.0
    per_token = 5 * (12 + 4 * 4) * 2  # layers x (latent + 4 RoPE keys of 4) x fp16
    assert report["kv_bytes_per_token_fp16_after"] == per_token < report["kv_bytes_per_token_fp16_before"]
    assert main(["plan", str(out), "--context", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == per_token
    model, held = load(out), 40
    for dtype in ("fp32", "fp16", "bf16"):
        cache = model.new_cache(1, held, dtype)
        with torch.no_grad():
            model(torch.tensor([IDS * 2 + IDS[:held - 2 * len(IDS)]]), cache=cache)
        assert cache.seq_len(0) == held
        assert cache.nbytes() == kv_bytes_per_sequence(load_model(str(out)), held, cache_formats(dtype, model_dtype="fp32"))
    agree = (logits(model).argmax(-1) == logits(source).argmax(-1)).float().mean()
    assert 0.3 < agree < 1  # approximate, not noise


@pytest.mark.parametrize("flags, match", [
    (["--to", "mla", "--layout", "kvlab", "--kv-lora-rank", "0"], "must be between 1 and the full rank 32"),
    (["--to", "mla", "--layout", "kvlab", "--kv-lora-rank", "33"], "must be between 1 and the full rank 32"),
    (["--to", "mla", "--layout", "kvlab", "--kv-lora-rank", "8", "--rope-dim", "3"],
     "must be even and between 2 and the head dim 8"),
    (["--to", "mla"], "needs one of --kv-lora-rank"),
    (["--to", "mla", "--kv-lora-rank", "8", "--kv-heads", "2"], "separate conversions"),
    (["--kv-lora-rank", "8"], "need --to mla"),
])
def test_bad_mla_requests_are_one_line_exit_2_and_leave_nothing(stories_path, tmp_path, capsys, flags, match):
    assert main(["convert", stories_path, *flags, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert err.startswith("kvlab convert: error:") and match in err
    assert os.listdir(tmp_path) == []


def test_transformers_cannot_load_the_extensions_exactly(stories_path, tmp_path, capsys):
    """What the help and README say: with 4 RoPE keys transformers' shapes do not match; with one
    (an MQA source) it loads but normalises the latent, so its logits are not kvlab's."""
    transformers = require_module("transformers")
    convert(stories_path, tmp_path / "g4", capsys, "--kv-lora-rank", "full")
    with pytest.raises(Exception, match="mismatch|size"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "g4", local_files_only=True)
    assert main(["convert", stories_path, "--kv-heads", "1", "--method", "mean", "-o", str(tmp_path / "mqa"),
                 "--json"]) == 0
    capsys.readouterr()
    convert(str(tmp_path / "mqa"), tmp_path / "g1", capsys, "--kv-lora-rank", "full")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "g1", local_files_only=True).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0]
    ours = logits(load(tmp_path / "g1"))
    torch.testing.assert_close(ours, logits(load(tmp_path / "mqa")), rtol=0, atol=5e-5)  # exact in kvlab
    assert (theirs - ours).abs().max() > 0.1  # transformers computes another function


def test_export_refuses_to_promise_vllm_serves_kvlabs_mla(stories_path, tmp_path, capsys):
    convert(stories_path, tmp_path / "mla", capsys, "--kv-lora-rank", "16")
    assert main(["export", str(tmp_path / "mla"), "--vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kvlab_rope_key_heads 4" in err[0] and "cannot serve" in err[0]
