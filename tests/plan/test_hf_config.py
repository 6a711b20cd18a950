"""config.json loader: real models' shapes, KV bytes and parameter counts, windows, and bad input.

Parameter counts are checked against the figures their authors publish (model cards,
papers); KV bytes against ../shared/reference/ANCHORS.md ("KV-cache arithmetic").
The configs are the published config.json files, cut to the fields the loader reads.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_bytes_per_token
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_config import load_hf_config, spec_from_hf_config

FP16 = cache_formats("fp16")

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 hidden_size=4096, intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                 tie_word_embeddings=False)
SMOLLM2_135M = dict(model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    hidden_size=576, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                    tie_word_embeddings=True)
MISTRAL_7B_V01 = dict(model_type="mistral", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      hidden_size=4096, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
                      sliding_window=4096, tie_word_embeddings=False)
MIXTRAL_8X7B = dict(model_type="mixtral", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    hidden_size=4096, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
QWEN25_7B = dict(model_type="qwen2", num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 hidden_size=3584, intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072,
                 sliding_window=131072, use_sliding_window=False, max_window_layers=28, tie_word_embeddings=False)
QWEN25_05B = dict(QWEN25_7B, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896,
                  intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, max_window_layers=21,
                  tie_word_embeddings=True)
QWEN15_MOE = dict(model_type="qwen2_moe", num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                  hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, vocab_size=151936,
                  max_position_embeddings=8192)
QWEN3_06B = dict(model_type="qwen3", num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, hidden_size=1024, intermediate_size=3072, vocab_size=151936,
                 max_position_embeddings=40960, tie_word_embeddings=True)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960)
GEMMA_7B = dict(model_type="gemma", num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                head_dim=256, hidden_size=3072, intermediate_size=24576, vocab_size=256000)
GEMMA2_9B = dict(model_type="gemma2", num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=256, hidden_size=3584, intermediate_size=14336, vocab_size=256000,
                 max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256)
GEMMA3_1B = dict(model_type="gemma3_text", num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, hidden_size=1152, intermediate_size=6912, vocab_size=262144,
                 max_position_embeddings=32768, sliding_window=512, sliding_window_pattern=6)
GEMMA3_4B = dict(model_type="gemma3", mm_tokens_per_image=256,  # the text_config as published: sparse
                 text_config=dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240,
                                  num_hidden_layers=34, sliding_window=1024),
                 vision_config=dict(model_type="siglip_vision_model", hidden_size=1152))
PHI3_MINI = dict(model_type="phi3", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 hidden_size=3072, intermediate_size=8192, vocab_size=32064, max_position_embeddings=4096,
                 sliding_window=2047, tie_word_embeddings=False)
FALCON_7B = dict(model_type="falcon", num_hidden_layers=32, num_attention_heads=71, hidden_size=4544,
                 vocab_size=65024, multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
                 alibi=False)
FALCON_40B = dict(model_type="falcon", num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
                  hidden_size=8192, vocab_size=65024, new_decoder_architecture=True, parallel_attn=True, bias=False)
GPT2 = dict(model_type="gpt2", n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257)
STARCODER = dict(model_type="gpt_bigcode", n_layer=40, n_head=48, n_embd=6144, n_positions=8192, vocab_size=49152,
                 multi_query=True)
STARCODER2_3B = dict(model_type="starcoder2", num_hidden_layers=30, num_attention_heads=24, num_key_value_heads=2,
                     hidden_size=3072, intermediate_size=12288, vocab_size=49152, max_position_embeddings=16384,
                     sliding_window=4096, use_bias=True)
PYTHIA_160M = dict(model_type="gpt_neox", num_hidden_layers=12, num_attention_heads=12, hidden_size=768,
                   intermediate_size=3072, vocab_size=50304, max_position_embeddings=2048)
DEEPSEEK_V2 = dict(model_type="deepseek_v2", num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
                   hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
                   n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                   q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400,
                   max_position_embeddings=163840)
DEEPSEEK_V3 = dict(DEEPSEEK_V2, model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168,
                   intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, first_k_dense_replace=3, vocab_size=129280, num_nextn_predict_layers=1)
GPT_OSS_20B = dict(model_type="gpt_oss", num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=201088, sliding_window=128, max_position_embeddings=131072,
                   layer_types=["sliding_attention", "full_attention"] * 12)


def spec(config, name="model"):
    return spec_from_hf_config(config, name)


def kinds(model):
    return [(layer.kind, layer.window) for layer in model.layers]


# (config, fp16 KV bytes per token, published parameter count, relative tolerance)
PUBLISHED = {
    "llama-3-8b": (LLAMA3_8B, 2 * 32 * 8 * 128 * 2, 8_030_261_248, 0),
    "smollm2-135m": (SMOLLM2_135M, 2 * 30 * 3 * 64 * 2, 134_515_008, 0),  # = its GGUF's tensor elements
    "mistral-7b-v0.1": (MISTRAL_7B_V01, 2 * 32 * 8 * 128 * 2, 7.24e9, 0.005),
    "mixtral-8x7b": (MIXTRAL_8X7B, 2 * 32 * 8 * 128 * 2, 46.7e9, 0.005),
    "qwen2.5-7b": (QWEN25_7B, 2 * 28 * 4 * 128 * 2, 7.61e9, 0.005),
    "qwen2.5-0.5b": (QWEN25_05B, 2 * 24 * 2 * 64 * 2, 0.494e9, 0.005),
    "qwen1.5-moe-a2.7b": (QWEN15_MOE, 2 * 24 * 16 * 128 * 2, 14.3e9, 0.005),
    "qwen3-0.6b": (QWEN3_06B, 2 * 28 * 8 * 128 * 2, 0.596e9, 0.005),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 2 * 48 * 4 * 128 * 2, 30.5e9, 0.005),
    "gemma-7b": (GEMMA_7B, 2 * 28 * 16 * 256 * 2, 8.54e9, 0.005),
    "gemma-2-9b": (GEMMA2_9B, 2 * 42 * 8 * 256 * 2, 9.24e9, 0.005),
    "gemma-3-1b": (GEMMA3_1B, 2 * 26 * 1 * 256 * 2, 1.0e9, 0.005),
    "phi-3-mini": (PHI3_MINI, 2 * 32 * 32 * 96 * 2, 3.82e9, 0.005),
    "falcon-7b": (FALCON_7B, 2 * 32 * 1 * 64 * 2, 6.92e9, 0.005),
    "gpt2": (GPT2, 2 * 12 * 12 * 64 * 2, 124_439_808, 0),
    "starcoder": (STARCODER, 2 * 40 * 1 * 128 * 2, 15.5e9, 0.005),
    "starcoder2-3b": (STARCODER2_3B, 2 * 30 * 2 * 128 * 2, 3.03e9, 0.005),
    "pythia-160m": (PYTHIA_160M, 2 * 12 * 12 * 64 * 2, 162_322_944, 0),  # Pythia paper, table of sizes
    "deepseek-v2": (DEEPSEEK_V2, 60 * (512 + 64) * 2, 236e9, 0.005),
    "deepseek-v3": (DEEPSEEK_V3, 61 * (512 + 64) * 2, 671e9, 0.005),
    "gpt-oss-20b": (GPT_OSS_20B, 2 * 24 * 8 * 64 * 2, 20.9e9, 0.005),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_kv_bytes_and_params_match_published_figures(name):
    config, kv_bytes, params, tolerance = PUBLISHED[name]
    model = spec(config, name)
    assert kv_bytes_per_token(model, FP16) == kv_bytes
    assert model.params_total == pytest.approx(params, rel=tolerance, abs=0)
    assert model.source == "config.json" and model.name == name


def test_llama3_8b_anchor_128kib_per_token_and_shape():
    model = spec(LLAMA3_8B)
    assert kv_bytes_per_token(model, FP16) == 131_072
    assert (model.num_layers, model.q_heads, model.kv_heads, model.head_dim) == (32, 32, 8, 128)
    assert (model.hidden_size, model.vocab_size, model.max_context) == (4096, 128256, 8192)
    assert not model.tied_embeddings and model.params_active is None


def test_smollm2_anchor_23040_bytes_per_token_tied():
    model = spec(SMOLLM2_135M)
    assert kv_bytes_per_token(model, FP16) == 23_040
    assert kv_bytes_per_sequence(model, 8192, FP16) == 188_743_680  # 188.7 MB = 180.0 MiB
    assert model.tied_embeddings


def test_moe_active_params_mixtral_12_9b_qwen3_3_3b():
    """Mixtral's own "12.9B active" counts attention, embeddings and 2 of 8 experts per layer."""
    assert spec(MIXTRAL_8X7B).params_active == pytest.approx(12.9e9, rel=0.005)
    assert spec(QWEN3_30B_A3B).params_active == pytest.approx(3.3e9, rel=0.02)
    assert spec(QWEN15_MOE).params_active == pytest.approx(2.7e9, rel=0.005)  # shared expert always on
    assert spec(DEEPSEEK_V2).params_active == pytest.approx(21e9, rel=0.02)
    assert spec(DEEPSEEK_V3).params_active == pytest.approx(37e9, rel=0.02)


def test_gpt_oss_active_params_differ_from_card_by_one_embedding_table():
    """The gpt-oss card's 3.6B active leaves out the input embedding; kvlab counts every weight touched."""
    model = spec(GPT_OSS_20B)
    assert model.params_active - 201088 * 2880 == pytest.approx(3.6e9, rel=0.01)


def test_deepseek_v2_mla_caches_576_elements_per_token_per_layer():
    """ANCHORS: MLA d_c + d_rope = 576 versus 2 x 128 heads x 128 = 32,768 for MHA (98.2% smaller)."""
    model = spec(DEEPSEEK_V2)
    assert all(layer.kind == "mla" for layer in model.layers) and model.num_layers == 60
    layer = model.layers[0]
    assert layer.kv_lora_rank + layer.qk_rope_head_dim == 576
    assert (layer.k_head_dim, layer.v_head_dim, layer.q_heads) == (192, 128, 128)
    assert kv_bytes_per_token(model, FP16) / 60 / 2 == 576
    assert round(1 - 576 / (2 * 128 * 128), 3) == 0.982


def test_kvlab_mla_extensions_count_one_rope_key_per_head_and_no_latent_norm():
    """kvlab_rope_key_heads G makes a row rank + G x rope; kvlab_latent_norm false drops rank norm
    weights per layer; a dense prefix over every layer is a dense model (no expert fields read)."""
    dense = dict(DEEPSEEK_V2, first_k_dense_replace=60, n_routed_experts=None, num_experts_per_tok=None)
    base = spec(dense)
    assert base.params_active is None and kv_bytes_per_token(base, FP16) == 60 * 576 * 2  # dense: no "active"
    converted = spec(dict(dense, kvlab_rope_key_heads=4, kvlab_latent_norm=False))
    assert converted.layers[0].latent_row == 512 + 4 * 64
    assert kv_bytes_per_token(converted, FP16) == 60 * (512 + 4 * 64) * 2
    assert converted.params_total - base.params_total == 60 * (3 * 64 * 5120 - 512)
    with pytest.raises(PlanError, match="kvlab_rope_key_heads"):
        spec(dict(dense, kvlab_rope_key_heads=0))


def test_deepseek_v3_notes_uncounted_mtp_layer_and_lite_without_q_lora():
    assert any("multi-token" in note for note in spec(DEEPSEEK_V3).notes)
    lite = dict(DEEPSEEK_V2, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, hidden_size=2048,
                intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, q_lora_rank=None)
    assert spec(lite).params_total == pytest.approx(15.7e9, rel=0.005)


def test_explicit_head_dim_wins_over_hidden_over_heads():
    """Qwen3-0.6B: hidden 1024 / 16 heads = 64, but head_dim says 128 (a 2x difference in cache)."""
    assert spec(QWEN3_06B).head_dim == 128
    assert spec(dict(LLAMA3_8B, head_dim=64)).head_dim == 64
    assert spec(dict(QWEN3_06B, head_dim=None)).head_dim == 64  # null: the family's rule applies


def test_omitted_fields_take_the_transformers_class_defaults():
    llama = {k: v for k, v in LLAMA3_8B.items() if k not in ("num_key_value_heads", "vocab_size")}
    model = spec(llama)
    assert model.kv_heads == 32 and model.vocab_size == 32000  # LlamaConfig: kv = heads, vocab 32000
    mistral = {k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}
    assert kinds(spec(mistral))[0] == ("sliding", 4096)  # MistralConfig's default window
    qwen3 = {k: v for k, v in QWEN3_06B.items() if k != "head_dim"}
    assert spec(qwen3).head_dim == 128  # Qwen3Config defaults head_dim to 128, not hidden/heads


def test_gemma3_multimodal_reads_text_config_with_gemma3_text_defaults():
    model = spec(GEMMA3_4B, "gemma-3-4b-it")
    assert (model.num_layers, model.q_heads, model.kv_heads, model.head_dim) == (34, 8, 4, 256)
    assert model.vocab_size == 262208 and model.max_context == 131072 and model.tied_embeddings
    assert model.params_total == pytest.approx(3.88e9, rel=0.005)  # 4.3B less the 0.42B vision tower
    assert any("vision" in note for note in model.notes)
    pattern = kinds(model)
    assert pattern.count(("full", None)) == 5 and pattern.count(("sliding", 1024)) == 29
    assert [i for i, kind in enumerate(pattern) if kind[0] == "full"] == [5, 11, 17, 23, 29]


def test_llava_style_wrapper_with_a_llama_text_config():
    model = spec(dict(model_type="llava", text_config=SMOLLM2_135M, vision_config={}))
    assert kv_bytes_per_token(model, FP16) == 23_040


def test_gemma2_alternates_local_and_global_from_layer_0():
    pattern = kinds(spec(GEMMA2_9B))
    assert pattern[:4] == [("sliding", 4096), ("full", None)] * 2 and len(pattern) == 42
    per_layer_token = 2 * 8 * 256 * 2  # K and V, 8 KV heads of 256, fp16
    assert kv_bytes_per_sequence(spec(GEMMA2_9B), 8192, FP16) == 21 * per_layer_token * (8192 + 4096)


def test_gemma3_sliding_window_pattern_every_nth_layer_global():
    pattern = kinds(spec(GEMMA3_1B))
    assert [i for i, kind in enumerate(pattern) if kind == ("full", None)] == [5, 11, 17, 23]
    assert kinds(spec(dict(GEMMA3_1B, sliding_window_pattern=2)))[:2] == [("sliding", 512), ("full", None)]


def test_explicit_layer_types_win_over_the_pattern():
    types = ["full_attention"] * 3 + ["sliding_attention"] * 23
    pattern = kinds(spec(dict(GEMMA3_1B, layer_types=types)))
    assert pattern[:3] == [("full", None)] * 3 and pattern[3:] == [("sliding", 512)] * 23


def test_gpt_oss_alternates_sliding_128_and_full():
    model = spec(GPT_OSS_20B)
    assert kinds(model) == [("sliding", 128), ("full", None)] * 12
    no_types = {k: v for k, v in GPT_OSS_20B.items() if k != "layer_types"}
    assert kinds(spec(no_types)) == kinds(model)
    assert kv_bytes_per_sequence(model, 100_000, FP16) == 12 * 2 * 8 * 64 * 2 * (100_000 + 128)


def test_mistral_window_caps_the_cache_and_null_means_full():
    model = spec(MISTRAL_7B_V01)
    assert kv_bytes_per_sequence(model, 32768, FP16) == kv_bytes_per_sequence(model, 4096, FP16)
    assert kinds(spec(dict(MISTRAL_7B_V01, sliding_window=None))) == [("full", None)] * 32


def test_phi3_and_starcoder2_window_every_layer():
    assert set(kinds(spec(PHI3_MINI))) == {("sliding", 2047)}
    assert set(kinds(spec(STARCODER2_3B))) == {("sliding", 4096)}


def test_qwen2_use_sliding_window_and_max_window_layers():
    assert set(kinds(spec(QWEN25_7B))) == {("full", None)}  # use_sliding_window false
    on = spec(dict(QWEN25_7B, use_sliding_window=True, sliding_window=4096, max_window_layers=20))
    assert kinds(on) == [("full", None)] * 20 + [("sliding", 4096)] * 8
    typed = dict(QWEN25_7B, layer_types=["sliding_attention"] * 28)  # no window switched on: full
    assert set(kinds(spec(typed))) == {("full", None)}


def test_falcon_multi_query_and_new_decoder_kv_heads():
    assert spec(FALCON_7B).kv_heads == 1
    falcon_40b = spec(FALCON_40B)
    assert (falcon_40b.kv_heads, falcon_40b.q_heads, falcon_40b.head_dim) == (8, 128, 64)
    assert kv_bytes_per_token(falcon_40b, FP16) == 2 * 60 * 8 * 64 * 2
    assert spec(dict(FALCON_7B, multi_query=False)).kv_heads == 71


def test_falcon_legacy_refinedweb_keys():
    rw_7b = dict(model_type="RefinedWebModel", n_layer=32, n_head=71, hidden_size=4544, vocab_size=65024,
                 multi_query=True, parallel_attn=True, bias=False)
    rw_40b = dict(model_type="RefinedWeb", n_layer=60, n_head=128, n_head_kv=8, hidden_size=8192, vocab_size=65024,
                  parallel_attn=True, bias=False)
    assert spec(rw_7b).params_total == spec(FALCON_7B).params_total and spec(rw_7b).kv_heads == 1
    assert spec(rw_40b).kv_heads == 8 and spec(rw_40b).params_total == spec(FALCON_40B).params_total


def test_gpt2_legacy_names_and_learned_positions():
    model = spec(GPT2)
    assert (model.num_layers, model.q_heads, model.kv_heads, model.hidden_size) == (12, 12, 12, 768)
    assert model.max_context == 1024 and model.tied_embeddings
    medium = spec(dict(GPT2, n_layer=24, n_head=16, n_embd=1024))
    assert medium.params_total == 354_823_168


def test_gpt_bigcode_multi_query_is_one_kv_head():
    assert spec(STARCODER).kv_heads == 1 and spec(STARCODER).max_context == 8192
    assert spec(dict(STARCODER, multi_query=False)).kv_heads == 48


def test_load_from_file_and_directory(tmp_path):
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_135M))
    for path in (folder, folder / "config.json"):
        model = load_hf_config(str(path))
        assert model.name == "SmolLM2-135M" and kv_bytes_per_token(model, FP16) == 23_040


def raises_one_line(match, call, *args):
    with pytest.raises(PlanError, match=match) as caught:
        call(*args)
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("text, match", [
    ('{"model_type": "llama", "num_hidden_layers": 32,', "not valid JSON.*truncated"),
    ("", "not valid JSON.*truncated"),
    ("{'model_type': 'llama'}", "not valid JSON"),
    ("[1, 2, 3]", "JSON object"),
    ("null", "JSON object"),
])
def test_malformed_or_truncated_files(tmp_path, text, match):
    path = tmp_path / "config.json"
    path.write_text(text)
    raises_one_line(match, load_hf_config, str(path))


def test_truncated_real_config_and_binary_file(tmp_path):
    text = json.dumps(LLAMA3_8B, indent=2)
    for cut in (1, len(text) // 3, len(text) - 2):
        (tmp_path / "config.json").write_text(text[:cut])
        raises_one_line("not valid JSON", load_hf_config, str(tmp_path))
    (tmp_path / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    raises_one_line("not UTF-8", load_hf_config, str(tmp_path))


def test_missing_paths(tmp_path):
    raises_one_line("no config.json", load_hf_config, str(tmp_path))
    raises_one_line("no config.json", load_hf_config, str(tmp_path / "absent.json"))


def test_unknown_or_missing_model_type_names_the_supported_families():
    message = raises_one_line("model_type 'mamba'", spec, dict(LLAMA3_8B, model_type="mamba"))
    assert "llama" in message and "deepseek_v3" in message and "gpt_oss" in message
    raises_one_line("no model_type", spec, {k: v for k, v in LLAMA3_8B.items() if k != "model_type"})
    raises_one_line("model_type", spec, dict(model_type="llava", text_config=dict(model_type="mamba")))


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size"])
def test_missing_required_fields(field):
    raises_one_line(field, spec, {k: v for k, v in LLAMA3_8B.items() if k != field})


@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", 0), ("num_attention_heads", -8), ("num_key_value_heads", 0), ("hidden_size", "4096"),
    ("intermediate_size", 14336.5), ("vocab_size", True), ("head_dim", -1), ("max_position_embeddings", 0),
    ("tie_word_embeddings", "yes"),
])
def test_zero_negative_or_mistyped_numbers(field, value):
    raises_one_line(field, spec, dict(LLAMA3_8B, **{field: value}))


def test_inconsistent_shapes():
    raises_one_line("must divide", spec, dict(LLAMA3_8B, num_key_value_heads=5))
    raises_one_line("head_dim", spec, dict(LLAMA3_8B, hidden_size=4100))
    raises_one_line("layer_types", spec, dict(GPT_OSS_20B, layer_types=["full_attention"] * 3))
    raises_one_line("chunked_attention", spec, dict(GPT_OSS_20B, layer_types=["chunked_attention"] * 24))
    raises_one_line("text_config", spec, dict(model_type="gemma3", text_config=[1]))
    raises_one_line("gemma3_text config lacks", spec, dict(model_type="gemma3"))


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 5000), st.floats(allow_nan=True), st.text(max_size=5),
                    st.lists(st.one_of(st.integers(-1, 3), st.lists(st.none(), max_size=1)), max_size=3),
                    st.dictionaries(st.text(), st.none()))


@given(st.sampled_from(sorted(PUBLISHED)), st.dictionaries(st.sampled_from(sorted(
    {key for config, *_ in PUBLISHED.values() for key in config} | {"layer_types", "text_config"})), _VALUES,
    max_size=3))
@settings(max_examples=300, deadline=None)
def test_any_corrupted_field_gives_a_spec_or_a_plan_error(name, corruption):
    """Whatever a config.json holds, the loader answers with a spec or one PlanError line, never a traceback."""
    try:
        model = spec(dict(PUBLISHED[name][0], **corruption))
    except PlanError as error:
        assert "\n" not in str(error)
    else:
        assert model.num_layers > 0 and model.params_total > 0
