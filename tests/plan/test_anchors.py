"""Every worked example in ../shared/reference/ANCHORS.md ("KV-cache arithmetic"), reproduced exactly."""

from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_bytes_per_token, seats
from kvlab.plan.kv_formats import resolve_kv_format
from kvlab.plan.presets import preset
from kvlab.plan.spec import ModelSpec, uniform_layers
from kvlab.plan.variants import apply_variant

FP16 = cache_formats("fp16")
KIB, MIB, GIB = 2**10, 2**20, 2**30


def shape(layers: int, heads: int, kv_heads: int, head_dim: int = 128) -> ModelSpec:
    return ModelSpec("anchor", uniform_layers(layers, heads, kv_heads, head_dim))


def test_llama2_7b_512kib_per_token_2gib_at_4k():
    spec = preset("llama-2-7b")
    assert kv_bytes_per_token(spec, FP16) == 512 * KIB
    assert kv_bytes_per_sequence(spec, 4096, FP16) == 2 * GIB


def test_llama3_8b_128kib_per_token_1gib_at_8k():
    spec = preset("llama-3-8b")
    assert kv_bytes_per_token(spec, FP16) == 128 * KIB
    assert kv_bytes_per_sequence(spec, 8192, FP16) == 1 * GIB


def test_seed_40_layer_mha_vs_gqa8_per_token_per_user_and_seats_in_9gib():
    mha, gqa = preset("seed-40l-kv32"), preset("seed-40l-kv8")
    assert kv_bytes_per_token(mha, FP16) == 655_360 == 640 * KIB
    assert kv_bytes_per_sequence(mha, 4096, FP16) == 2560 * MIB
    assert kv_bytes_per_token(gqa, FP16) == 160 * KIB
    assert kv_bytes_per_sequence(gqa, 4096, FP16) == 640 * MIB
    assert seats(mha, 9 * GIB, 4096, FP16) == 3
    assert seats(gqa, 9 * GIB, 4096, FP16) == 14


def test_80_layer_gqa8_320kib_per_token_40gib_at_128k():
    spec = shape(80, 64, 8)
    assert kv_bytes_per_token(spec, FP16) == 320 * KIB
    assert kv_bytes_per_sequence(spec, 131_072, FP16) == 40 * GIB


def test_30_layer_40_head_mha_2048_tokens():
    spec = shape(30, 40, 40)
    assert kv_bytes_per_sequence(spec, 2048, FP16) == 1_258_291_200
    assert round(1_258_291_200 / GIB, 2) == 1.17


def test_llama2_70b_as_mha_gqa8_mqa_at_4k():
    base = preset("llama-2-70b")
    mha, gqa, mqa = (apply_variant(base, name) for name in ("mha", "gqa:8", "mqa"))
    assert round(kv_bytes_per_sequence(mha, 4096, FP16) / 1e9, 1) == 10.7
    assert round(kv_bytes_per_sequence(gqa, 4096, FP16) / 1e9, 2) == 1.34
    assert round(kv_bytes_per_sequence(mqa, 4096, FP16) / 1e6) == 168  # "167 MB": 167.77 MB
    assert kv_bytes_per_sequence(mqa, 4096, FP16) == 167_772_160


def test_deepseek_v2_mla_576_elements_vs_32768_for_mha():
    elements = cache_formats("fp16")
    mla = preset("deepseek-v2")
    per_layer = kv_bytes_per_token(mla, elements) // mla.num_layers // 2
    assert per_layer == 576
    mha = shape(1, 128, 128, 128)
    assert kv_bytes_per_token(mha, elements) // 2 == 32_768
    assert round(1 - 576 / 32_768, 3) == 0.982


def test_smollm2_135m_23040_bytes_per_token():
    spec = preset("smollm2-135m")
    assert kv_bytes_per_token(spec, FP16) == 23_040
    at_8k = kv_bytes_per_sequence(spec, 8192, FP16)
    assert round(at_8k / 1e6, 1) == 188.7 and round(at_8k / MIB, 1) == 180.0


def test_llama31_8b_bf16_131072_bytes_per_token():
    assert kv_bytes_per_token(preset("llama-3.1-8b"), cache_formats("bf16")) == 131_072


def test_kivi2_average_bits_305_at_32k():
    """KIVI: (b + 32/G)(L - R)/L + 16R/L = 3.05 bits for b=2, G=32, R=128, L=32K."""
    fmt = resolve_kv_format("kivi2")
    tokens, dim = 32 * 1024, 128
    for role in ("k", "v"):
        bits = fmt.bytes(role, 1, dim, tokens) * 8 / (tokens * dim)
        assert round(bits, 2) == 3.05
