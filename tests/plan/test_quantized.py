"""Weights as the checkpoint ships them: quantization_config counted tensor by tensor, against published sizes.

Each config below is the published config.json's shape fields and its quantization_config as
published; each size is the published checkpoint's:

- gpt-oss-20b 12.8 GiB and gpt-oss-120b 60.8 GiB: the gpt-oss model card (arXiv 2508.10925),
  table 1, "checkpoint size" (MXFP4 experts; attention, router, embeddings, head in bf16).
- DeepSeek-V3 688,586,727,753 B: the safetensors files of deepseek-ai/DeepSeek-V3 at revision
  afb92e1fa402c2be2a9eb085312bb02e0384d6c7 (FP8 e4m3 with fp32 128 x 128 block scales; the
  multi-token-prediction layer 61 ships in it, README_WEIGHTS.md: 671B main + 14B MTP).
- hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4 5.73 GB: its two shards, 4.68 GB + 1.05 GB
  (the Hugging Face file listing).
- Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 5.58 GB: its two shards, 4 GB + 1.58 GB (file listing).
"""

import json

import pytest

from kvlab.cli import main
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_config import spec_from_hf_config
from kvlab.plan.quantized import matches
from kvlab.plan.weights import weight_bytes

from test_hf_config import DEEPSEEK_V3, GPT_OSS_20B, LLAMA3_8B

GIB = 2**30
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
GPT_OSS_20B_Q = dict(GPT_OSS_20B, quantization_config=MXFP4, torch_dtype="bfloat16")
GPT_OSS_120B_Q = dict(GPT_OSS_20B_Q, num_hidden_layers=36, num_local_experts=128,
                      layer_types=["sliding_attention", "full_attention"] * 18)
DEEPSEEK_V3_FP8 = dict(DEEPSEEK_V3, num_nextn_predict_layers=1, torch_dtype="bfloat16", quantization_config={
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})
LLAMA31_8B_AWQ = dict(LLAMA3_8B, max_position_embeddings=131072, torch_dtype="float16", quantization_config={
    "bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
    "zero_point": True})
QWEN25_7B_GPTQ = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                      tie_word_embeddings=False, torch_dtype="float16", quantization_config={
                          "bits": 4, "damp_percent": 0.01, "desc_act": False, "group_size": 128,
                          "quant_method": "gptq", "static_groups": False, "sym": True, "true_sequential": True})

PUBLISHED = {
    "gpt-oss-20b": (GPT_OSS_20B_Q, 12.8 * GIB),
    "gpt-oss-120b": (GPT_OSS_120B_Q, 60.8 * GIB),
    "deepseek-v3": (DEEPSEEK_V3_FP8, 688_586_727_753),
    "llama-3.1-8b-awq": (LLAMA31_8B_AWQ, 4.68e9 + 1.05e9),
    "qwen2.5-7b-gptq": (QWEN25_7B_GPTQ, 4e9 + 1.58e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_weight_bytes_as_shipped_within_two_percent_of_the_published_checkpoint(name):
    config, published = PUBLISHED[name]
    spec = spec_from_hf_config(config, name)
    shipped = spec.checkpoint_bytes or spec.weight_bytes
    assert shipped == pytest.approx(published, rel=0.02)
    assert weight_bytes(spec) == spec.weight_bytes  # "auto" is the checkpoint as shipped
    assert spec.weight_format and spec.weight_bytes < spec.params_total * 2


def test_mxfp4_is_four_and_a_quarter_bits_on_the_experts_only():
    """gpt-oss-20b: 24 layers x 32 experts x (2880 x 5760 + 2880 x 2880) expert weights at 17 bytes per 32
    values (16 of codes, 1 E8M0 scale); every other parameter in bf16."""
    spec = spec_from_hf_config(GPT_OSS_20B_Q, "gpt-oss-20b")
    experts = 24 * 32 * (2880 * 5760 + 2880 * 2880)
    assert spec.weight_bytes == experts // 32 * 17 + 2 * (spec.params_total - experts)
    kept = dict(GPT_OSS_20B_Q, quantization_config=dict(MXFP4, modules_to_not_convert=MXFP4[
        "modules_to_not_convert"] + ["model.layers.0.mlp.experts"]))  # an exclusion is honoured
    assert spec_from_hf_config(kept, "m").weight_bytes - spec.weight_bytes == \
        experts // 24 * 2 - experts // 24 // 32 * 17


def test_fp8_block_scales_are_one_fp32_per_128_by_128_block_and_mtp_ships_but_is_not_loaded():
    spec = spec_from_hf_config(DEEPSEEK_V3_FP8, "deepseek-v3")
    assert spec.checkpoint_bytes > spec.weight_bytes  # layer 61 (MTP) is in the files, not in what vLLM loads
    assert spec.weight_bytes == pytest.approx(671e9, rel=0.01)  # about a byte per parameter
    # one 7168 x 2048 expert matrix: 7168 * 2048 bytes + 56 x 16 fp32 scales
    per_tensor = dict(DEEPSEEK_V3_FP8, quantization_config=dict(DEEPSEEK_V3_FP8["quantization_config"],
                                                                weight_block_size=None))
    assert spec.weight_bytes > spec_from_hf_config(per_tensor, "m").weight_bytes


def test_awq_and_gptq_count_codes_scales_zeros_and_gptq_g_idx():
    """int4, group 128: per (out x in) matrix, out*in/2 codes + out*in/128 fp16 scales + out*in/128 int4
    zeros; GPTQ adds an int32 g_idx per input column."""
    awq = spec_from_hf_config(dict(QWEN25_7B_GPTQ, quantization_config=dict(QWEN25_7B_GPTQ["quantization_config"],
                                                                           quant_method="awq")), "awq")
    gptq = spec_from_hf_config(QWEN25_7B_GPTQ, "gptq")
    in_columns = 28 * (4 * 3584 + 2 * 3584 + 18944)  # q, k, v, o, gate, up read 3584; down reads 18944
    assert gptq.weight_bytes - awq.weight_bytes == 4 * in_columns


def test_compressed_tensors_groups_channels_nvfp4_and_ignore():
    base = dict(LLAMA3_8B, torch_dtype="bfloat16")
    w4a16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
    spec = spec_from_hf_config(dict(base, quantization_config=w4a16), "w4a16")
    linears = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    assert spec.weight_bytes == linears // 2 + linears // 128 * 2 + 32 * 7 * 16 + 2 * (spec.params_total - linears)
    nvfp4 = dict(w4a16, format="nvfp4-pack-quantized", config_groups={"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}})
    spec = spec_from_hf_config(dict(base, quantization_config=nvfp4), "nvfp4")
    assert spec.weight_bytes == linears // 2 + linears // 16 + 32 * 7 * 8 + 2 * (spec.params_total - linears)
    fp8 = dict(w4a16, format="float-quantized", ignore=["lm_head", "re:.*down_proj"], config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}})
    spec = spec_from_hf_config(dict(base, quantization_config=fp8), "fp8")
    converted = linears - 32 * 4096 * 14336
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336)
    assert spec.weight_bytes == converted + 2 * rows + 2 * (spec.params_total - converted)


def test_bitsandbytes_nf4_double_quant_and_int8():
    base = dict(LLAMA3_8B, torch_dtype="bfloat16")
    nf4 = spec_from_hf_config(dict(base, quantization_config={
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True}), "nf4")
    int8 = spec_from_hf_config(dict(base, quantization_config={"quant_method": "bitsandbytes",
                                                               "load_in_8bit": True}), "int8")
    linears = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    assert nf4.weight_bytes / nf4.params_total < int8.weight_bytes / int8.params_total < 2
    # nf4 with double quantisation: 4 bits + 1 byte per 64 values (+ fp32 per 256 blocks): about 4.127 bits
    assert (nf4.weight_bytes - 2 * (nf4.params_total - linears)) * 8 / linears == pytest.approx(4.127, abs=0.002)


def test_exclusion_patterns_match_as_their_libraries_match():
    assert matches("model.layers.3.self_attn.q_proj", "model.layers.*.self_attn")
    assert matches("lm_head", "lm_head") and not matches("model.layers.0.mlp.gate_proj", "gate")
    assert matches("model.layers.0.mlp.gate", "gate")
    assert matches("model.layers.7.mlp.gate", "re:.*mlp.gate$")
    assert not matches("model.layers.7.mlp.gate_proj", "re:.*mlp.gate$")


def test_weight_dtype_overrides_what_ships_and_knows_mxfp4_and_nvfp4():
    spec = spec_from_hf_config(GPT_OSS_20B_Q, "gpt-oss-20b")
    assert weight_bytes(spec, "bf16") == 2 * spec.params_total
    assert weight_bytes(spec, "mxfp4") == -(-(spec.params_total * 4 + -(-spec.params_total // 32) * 8) // 8)
    assert weight_bytes(spec, "nvfp4") > weight_bytes(spec, "mxfp4")


@pytest.mark.parametrize("bad", [{"quant_method": "hqq"}, {"quant_method": "awq", "bits": "four"},
                                 {"quant_method": "fp8", "weight_block_size": [128]},
                                 {"quant_method": "compressed-tensors"}, {"quant_method": "bitsandbytes"}, []])
def test_bad_quantization_config_is_one_plan_error(bad):
    with pytest.raises(PlanError):
        spec_from_hf_config(dict(LLAMA3_8B, quantization_config=bad), "m")


def test_gpt_oss_fits_a_24_gb_card_as_shipped(tmp_path, capsys):
    """The issue's case: counted as bf16 gpt-oss-20b "does not fit" a 24 GB card; as shipped it does."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B_Q))
    assert main(["plan", str(tmp_path), "--gpu", "rtx-4090", "--context", "8192", "--batch", "4", "--json"]) == 0
    shipped = json.loads(capsys.readouterr().out)
    assert shipped["fits"] and shipped["weight_bytes"] == pytest.approx(12.8 * GIB, rel=0.01)
    assert "mxfp4" in shipped["model"]["weight_format"]
    assert main(["plan", str(tmp_path), "--gpu", "rtx-4090", "--weight-dtype", "bf16", "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["fits"]
