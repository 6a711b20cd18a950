"""The second-pass config.json families: Llama 4, Gemma 4, Qwen3-Next, Phi-3.5-MoE, and their wrappers.

Configs are the models' published config.json shapes, cut to the fields the loader reads
(fields left out take transformers 5.x's config class defaults, as transformers does).
Parameter counts are checked against the model cards; KV bytes are written out by hand
from the layer pattern, per layer kind, so a wrong pattern or head count fails them.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cli import main
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_bytes_per_token, state_bytes
from kvlab.plan.errors import PlanError
from kvlab.plan.hf_config import spec_from_hf_config

BF16 = cache_formats("auto", model_dtype="bf16")

LLAMA4_SCOUT = dict(model_type="llama4", tie_word_embeddings=False,
                    vision_config=dict(model_type="llama4_vision_model"),
                    text_config=dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192,
                                     intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                                     num_key_value_heads=8, head_dim=128, num_local_experts=16,
                                     num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=202048,
                                     max_position_embeddings=10485760, attention_chunk_size=8192,
                                     no_rope_layers=[], use_qk_norm=True))
LLAMA4_MAVERICK = dict(LLAMA4_SCOUT, text_config=dict(LLAMA4_SCOUT["text_config"], num_local_experts=128,
                                                      interleave_moe_layer_step=2, max_position_embeddings=1048576))
GEMMA4_31B = dict(model_type="gemma4", vision_config=dict(model_type="gemma4_vision"),
                  text_config=dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504,
                                   num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16,
                                   head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
                                   attention_k_eq_v=True, sliding_window=1024, vocab_size=262144,
                                   max_position_embeddings=262144, hidden_size_per_layer_input=0,
                                   final_logit_softcapping=30.0, tie_word_embeddings=True))
QWEN3_NEXT_80B = dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                      linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, vocab_size=151936, max_position_embeddings=262144,
                      full_attention_interval=4, decoder_sparse_step=1, tie_word_embeddings=False)
PHI35_MOE = dict(model_type="phimoe", hidden_size=4096, intermediate_size=6400, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32064, max_position_embeddings=131072,
                 sliding_window=131072, attention_bias=True, lm_head_bias=True, num_local_experts=16,
                 num_experts_per_tok=2)

# bf16 bytes of K and V for one token in one layer
SCOUT_LAYER = 2 * 8 * 128 * 2
GEMMA4_SLIDING, GEMMA4_GLOBAL = 2 * 16 * 256 * 2, 2 * 4 * 512 * 2
QWEN3_NEXT_LAYER = 2 * 2 * 256 * 2
# Gated DeltaNet state: conv over q, k, v for kernel - 1 steps, plus 32 heads of 128 x 128
QWEN3_NEXT_STATE = ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 2


def spec(config, name="model"):
    return spec_from_hf_config(config, name)


def kinds(model):
    return [(layer.kind, layer.window) for layer in model.layers]


# (config, bf16 KV bytes per token, published total parameters, tolerance, published active or None)
PUBLISHED = {
    # Meta's cards: 109B total / 17B active (Scout), 400B / 17B (Maverick), vision encoder included
    "llama-4-scout": (LLAMA4_SCOUT, 48 * SCOUT_LAYER, 109e9, 0.015, 17e9),
    "llama-4-maverick": (LLAMA4_MAVERICK, 48 * SCOUT_LAYER, 400e9, 0.005, 17e9),
    "gemma-4-31b": (GEMMA4_31B, 50 * GEMMA4_SLIDING + 10 * GEMMA4_GLOBAL, 30.7e9, 0.005, None),
    "qwen3-next-80b-a3b": (QWEN3_NEXT_80B, 12 * QWEN3_NEXT_LAYER, 80e9, 0.005, None),
    "phi-3.5-moe": (PHI35_MOE, 32 * 2 * 8 * 128 * 2, 41.9e9, 0.005, 6.6e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_kv_bytes_and_params_match_published_figures(name):
    config, per_token, params, tolerance, active = PUBLISHED[name]
    model = spec(config, name)
    assert kv_bytes_per_token(model, BF16) == per_token
    assert model.params_total == pytest.approx(params, rel=tolerance, abs=0)
    if active is not None:
        assert model.active_params == pytest.approx(active, rel=0.015, abs=0)


def test_llama4_chunks_three_layers_of_four_and_caps_them_at_the_chunk():
    model = spec(LLAMA4_SCOUT, "scout")
    pattern = kinds(model)
    assert [i for i, kind in enumerate(pattern) if kind == ("full", None)] == list(range(3, 48, 4))
    assert pattern.count(("chunked", 8192)) == 36
    assert kv_bytes_per_sequence(model, 100_000, BF16) == SCOUT_LAYER * (12 * 100_000 + 36 * 8192)
    assert kv_bytes_per_sequence(model, 5000, BF16) == SCOUT_LAYER * 48 * 5000  # within one chunk
    assert any("vision" in note for note in model.notes)


def test_llama4_explicit_patterns_and_a_null_chunk():
    text = LLAMA4_SCOUT["text_config"]
    typed = dict(text, layer_types=["full_attention"] * 8 + ["chunked_attention"] * 40)
    assert kinds(spec(typed))[:9] == [("full", None)] * 8 + [("chunked", 8192)]
    no_rope = dict(text, no_rope_layers=[1, 0] * 24)  # 1: RoPE (chunked), 0: NoPE (global)
    assert kinds(spec(no_rope))[:2] == [("chunked", 8192), ("full", None)]
    assert set(kinds(spec(dict(text, attention_chunk_size=None)))) == {("full", None)}
    with pytest.raises(PlanError, match="attention_chunk_size is null"):
        spec(dict(typed, attention_chunk_size=None))


def test_llama4_maverick_interleaves_moe_and_dense_layers():
    scout, maverick = spec(LLAMA4_SCOUT), spec(LLAMA4_MAVERICK)
    dense = 3 * 5120 * 16384  # intermediate_size_mlp on Maverick's 24 dense layers
    expert = 3 * 5120 * 8192
    scout_layer_active = 5120 * 16 + 2 * expert  # router over 16, the shared expert, one routed expert
    # Maverick: every other layer dense; its MoE layers route over 128 experts, not 16
    assert maverick.active_params - scout.active_params == 24 * (dense - scout_layer_active) + 24 * 5120 * 112


def test_gemma4_global_layers_have_their_own_heads_and_dims():
    model = spec(GEMMA4_31B, "gemma-4-31b")
    globals_ = [i for i, layer in enumerate(model.layers) if layer.kind == "full"]
    assert globals_ == list(range(5, 60, 6))
    assert {(layer.kv_heads, layer.k_head_dim) for layer in model.layers if layer.kind == "full"} == {(4, 512)}
    assert {(layer.kv_heads, layer.k_head_dim, layer.window) for layer in model.layers
            if layer.kind == "sliding"} == {(16, 256, 1024)}
    assert kv_bytes_per_sequence(model, 100_000, BF16) == 10 * GEMMA4_GLOBAL * 100_000 + 50 * GEMMA4_SLIDING * 1024
    assert model.max_context == 262144 and model.tied_embeddings


def test_gemma4_k_eq_v_drops_the_v_projection_not_the_cached_values():
    text = GEMMA4_31B["text_config"]
    shared_kv = spec(text)
    separate = spec(dict(text, attention_k_eq_v=False))  # then global layers keep num_key_value_heads and a v_proj
    assert kv_bytes_per_token(separate, BF16) == 50 * GEMMA4_SLIDING + 10 * 2 * 16 * 512 * 2
    k_proj_4 = 5376 * 4 * 512
    assert separate.params_total - shared_kv.params_total == 10 * (2 * 5376 * 16 * 512 - k_proj_4)


def test_gemma4_kv_shared_layers_hold_no_cache_and_the_last_layer_is_global():
    text = dict(GEMMA4_31B["text_config"], num_kv_shared_layers=12)
    model = spec(text)
    assert [layer.kv_shared for layer in model.layers] == [False] * 48 + [True] * 12
    assert kv_bytes_per_token(model, BF16) == 40 * GEMMA4_SLIDING + 8 * GEMMA4_GLOBAL
    typed = dict(GEMMA4_31B["text_config"], layer_types=["sliding_attention"] * 60)
    assert kinds(spec(typed))[-1] == ("full", None)  # transformers forces the last layer global


def test_gemma4_wrapper_without_model_type_takes_gemma4_text_defaults():
    model = spec(dict(model_type="gemma4", text_config=dict(hidden_size=1536, num_hidden_layers=12)))
    assert {(layer.kind, layer.kv_heads, layer.k_head_dim, layer.window) for layer in model.layers} == \
        {("sliding", 4, 256, 512), ("full", 4, 512, None)}
    assert model.params_total > 262144 * 12 * 256  # the per-layer embedding table (PLE) is counted


def test_qwen3_next_linear_layers_hold_a_fixed_state_per_sequence():
    model = spec(QWEN3_NEXT_80B, "qwen3-next")
    assert [i for i, layer in enumerate(model.layers) if layer.kind == "full"] == list(range(3, 48, 4))
    assert sum(layer.is_state for layer in model.layers) == 36
    for tokens in (1, 4096, 262144):
        assert kv_bytes_per_sequence(model, tokens, BF16) == 12 * QWEN3_NEXT_LAYER * tokens + 36 * QWEN3_NEXT_STATE
    assert kv_bytes_per_sequence(model, 0, BF16) == 0
    state_layer = model.layers[0]
    assert state_bytes(state_layer, BF16, tensor_parallel=2) == QWEN3_NEXT_STATE // 2
    assert state_bytes(state_layer, cache_formats("fp8", model_dtype="fp32")) == 2 * QWEN3_NEXT_STATE  # model dtype


def test_qwen3_next_kv_heads_what_if_leaves_linear_layers_alone():
    model = spec(QWEN3_NEXT_80B).with_kv_heads(1)
    assert kv_bytes_per_token(model, BF16) == 12 * 2 * 1 * 256 * 2
    assert sum(layer.is_state for layer in model.layers) == 36


def test_plan_json_reports_the_state_and_the_cli_plans_it(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_NEXT_80B))
    assert main(["plan", str(path), "--dtype", "bf16", "--context", "1000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["state_bytes_per_sequence"] == 36 * QWEN3_NEXT_STATE
    assert result["kv_bytes_per_sequence"] == 12 * QWEN3_NEXT_LAYER * 1000 + 36 * QWEN3_NEXT_STATE
    assert result["model"]["state_layers"] == 36 and result["model"]["attention_kinds"] == ["full", "state"]
    assert main(["plan", str(path), "--dtype", "bf16", "--kv-cache-memory", "8GiB"]) == 0
    assert "per sequence, any context" in capsys.readouterr().out


def test_phimoe_layernorms_biases_and_window():
    model = spec(PHI35_MOE)
    assert set(kinds(model)) == {("sliding", 131072)}
    no_bias = spec(dict(PHI35_MOE, lm_head_bias=False))
    assert model.params_total - no_bias.params_total == 32064


def test_refused_family_names_the_new_supported_ones():
    with pytest.raises(PlanError) as error:
        spec(dict(model_type="jamba", num_hidden_layers=4, hidden_size=64))
    message = str(error.value)
    assert "\n" not in message and "model_type 'jamba'" in message
    named = message.split("supported families: ")[1].split(", ")
    assert {"llama4", "llama4_text", "gemma4", "gemma4_text", "qwen3_next", "phimoe", "llama"} <= set(named)


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 5000), st.floats(allow_nan=True), st.text(max_size=5),
                    st.lists(st.one_of(st.integers(-1, 3), st.text(max_size=20)), max_size=3))
_FLAT = {name: (config["text_config"] if "text_config" in config else config) for name, (config, *_) in
         PUBLISHED.items()}


@given(st.sampled_from(sorted(_FLAT)), st.dictionaries(st.sampled_from(sorted(
    {key for config in _FLAT.values() for key in config} | {"layer_types", "full_attention_interval",
                                                            "no_rope_layers", "moe_layers"})), _VALUES,
    max_size=3))
@settings(max_examples=300, deadline=None)
def test_any_corrupted_field_gives_a_spec_or_a_plan_error(name, corruption):
    """Whatever a config.json holds, the loader answers with a spec or one PlanError line, never a traceback."""
    try:
        model = spec(dict(_FLAT[name], **corruption))
    except PlanError as error:
        assert "\n" not in str(error)
    else:
        assert model.num_layers > 0 and model.params_total > 0


def test_chunked_attention_pairs_and_state_layers_in_the_roofline():
    from kvlab.plan.roofline import attention_flops, chunked_pairs
    assert chunked_pairs(10, 4) == 10 + 10 + 3  # chunks [0..3], [4..7] (4*5/2 each), then [8, 9]
    assert chunked_pairs(8192, 8192) == 8192 * 8193 // 2
    model = spec(QWEN3_NEXT_80B)
    per_pair = 2 * 16 * (256 + 256)
    assert attention_flops(model, 1, 99) == 12 * per_pair * 100  # only the 12 full layers attend


def test_plan_names_gemma4s_two_layer_shapes_and_the_table_shows_them(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA4_31B))
    assert main(["plan", str(path), "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["layer_shapes"] == [dict(kind="sliding", layers=50, kv_heads=16, head_dim=256),
                                     dict(kind="full", layers=10, kv_heads=4, head_dim=512)]
    assert main(["plan", str(path)]) == 0
    assert "10 full: 4 KV heads x 512" in capsys.readouterr().out
    assert main(["plan", str(tmp_path), "--kv-heads", "3"]) == 2  # a what-if must divide the 32 query heads


def test_gemma4_kv_sharing_must_leave_a_layer_its_own_cache():
    with pytest.raises(PlanError, match="num_kv_shared_layers"):
        spec(dict(GEMMA4_31B["text_config"], num_kv_shared_layers=60))
