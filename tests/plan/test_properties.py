"""Exact ratios and properties that must hold for any shape (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_bytes_per_token, max_context, seats
from kvlab.plan.spec import ModelSpec, uniform_layers

BITS_ORDER = ("fp32", "fp16", "int8", "int4", "int2")  # fp8 (no scales) sits beside int8: same bits
shapes = st.tuples(st.integers(1, 96), st.sampled_from([1, 2, 4, 8, 16, 32, 64]), st.integers(0, 6),
                   st.sampled_from([32, 64, 80, 96, 128, 256]))


def build(layers: int, heads: int, group_log: int, head_dim: int) -> ModelSpec:
    kv = max(1, heads >> group_log)
    return ModelSpec("p", uniform_layers(layers, heads, kv, head_dim))


@given(shapes, st.integers(1, 200_000))
@settings(max_examples=60, deadline=None)
def test_mha_gqa_mqa_ratios_are_exact(shape, tokens):
    spec = build(*shape)
    mha, mqa = spec.with_kv_heads(spec.q_heads), spec.with_kv_heads(1)
    fmt = cache_formats("fp16")
    assert kv_bytes_per_sequence(mha, tokens, fmt) == spec.q_heads * kv_bytes_per_sequence(mqa, tokens, fmt)
    assert kv_bytes_per_sequence(spec, tokens, fmt) * spec.q_heads == \
        kv_bytes_per_sequence(mha, tokens, fmt) * spec.kv_heads


@given(shapes, st.integers(0, 200_000))
@settings(max_examples=60, deadline=None)
def test_fp8_is_exactly_half_of_fp16(shape, tokens):
    spec = build(*shape)
    fp16, fp8 = cache_formats("fp16"), cache_formats("fp8")
    assert 2 * kv_bytes_per_sequence(spec, tokens, fp8) == kv_bytes_per_sequence(spec, tokens, fp16)
    assert 2 * kv_bytes_per_token(spec, cache_formats("fp8_e5m2")) == kv_bytes_per_token(spec, fp16)


@given(shapes, st.integers(1, 100_000), st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_bytes_grow_with_every_term(shape, tokens, extra):
    layers, heads, group_log, head_dim = shape
    spec = build(*shape)
    fmt = cache_formats("fp16")
    base = kv_bytes_per_sequence(spec, tokens, fmt)
    assert kv_bytes_per_sequence(spec, tokens + extra, fmt) > base
    assert kv_bytes_per_sequence(build(layers + extra, heads, group_log, head_dim), tokens, fmt) > base
    assert kv_bytes_per_sequence(build(layers, heads, group_log, head_dim + 16 * extra), tokens, fmt) > base
    if spec.kv_heads < spec.q_heads:
        more = spec.with_kv_heads(spec.kv_heads * 2)
        assert kv_bytes_per_sequence(more, tokens, fmt) > base


@given(shapes, st.integers(1, 100_000), st.sampled_from(["kivi2", "kivi4"]))
@settings(max_examples=60, deadline=None)
def test_lower_precision_never_costs_more(shape, tokens, kivi):
    spec = build(*shape)
    figures = [kv_bytes_per_sequence(spec, tokens, cache_formats(name)) for name in BITS_ORDER]
    assert figures == sorted(figures, reverse=True)
    assert kv_bytes_per_sequence(spec, tokens, cache_formats("fp8")) <= figures[1]
    assert kv_bytes_per_sequence(spec, tokens, cache_formats("kivi2")) <= \
        kv_bytes_per_sequence(spec, tokens, cache_formats("kivi4"))
    assert kv_bytes_per_sequence(spec, tokens, cache_formats(kivi)) <= kv_bytes_per_sequence(spec, tokens, cache_formats("fp16"))


@given(shapes, st.integers(1, 1 << 36), st.integers(1, 65_536), st.integers(1, 64),
       st.sampled_from(["fp16", "fp8", "int4", "kivi2"]))
@settings(max_examples=80, deadline=None)
def test_seats_and_max_context_never_exceed_the_budget(shape, budget, context, batch, dtype):
    spec = build(*shape)
    fmt = cache_formats(dtype)
    per_sequence = kv_bytes_per_sequence(spec, context, fmt)
    fitted = seats(spec, budget, context, fmt)
    assert fitted * per_sequence <= budget < (fitted + 1) * per_sequence
    longest = max_context(spec, budget, batch, fmt)
    assert batch * kv_bytes_per_sequence(spec, longest, fmt) <= budget
    assert batch * kv_bytes_per_sequence(spec, longest + 1, fmt) > budget
