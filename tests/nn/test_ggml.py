"""GGMLLinear: kvlab's C kernels on planes of GGUF blocks (q4_1, q8_0 and q6_k kinds)."""

import numpy as np
import pytest
import torch

from kvlab.errors import KvlabEnvironmentError
from kvlab.nn.ggml import GROUP, GGMLLinear, PackedPlanes, Planes, quantize_activations, stack_planes
from kvlab.nn.kernels import KERNEL_ISAS, fp8_attention_isa, kernel_isa, kernels, using_kernel_isa

from needs import require_kernels

pytestmark = pytest.mark.usefixtures("kernels_lib")


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()


def random_planes(kind: str, out_features: int, in_features: int, rng: np.random.Generator) -> Planes:
    """Random planes with fp16-representable scales, as GGUF blocks would give."""
    groups = (out_features, in_features // GROUP[kind])
    scales = torch.from_numpy(rng.uniform(0.001, 0.02, groups).astype(np.float16).astype(np.float32))
    if kind == "q4_1":
        codes = torch.from_numpy(rng.integers(0, 16, (out_features, in_features), dtype=np.uint8))
        offsets = torch.from_numpy(rng.uniform(-0.2, 0.0, groups).astype(np.float16).astype(np.float32))
        return Planes(kind, codes, scales, offsets)
    low, high = (-128, 128) if kind == "q8_0" else (-32, 32)
    return Planes(kind, torch.from_numpy(rng.integers(low, high, (out_features, in_features)).astype(np.int8)), scales)


@pytest.mark.parametrize("kind", sorted(GROUP))
def test_weights_decode_exactly_and_products_match(kind):
    planes = random_planes(kind, 96, 160, np.random.default_rng(0))
    layer = GGMLLinear(planes)
    dense = planes.dense()
    assert torch.equal(layer.weight, dense)  # the C dequantiser, exactly
    coarse = GGMLLinear(planes, "int8")
    for rows in (1, 3, 4, 9, 70):  # row by row, then the interleaved kernel (tiles of 4, chunks of 64)
        x = torch.randn(rows, 160)
        expected = x @ dense.t()
        error = lambda got: ((got - expected).norm() / expected.norm()).item()  # noqa: E731
        assert error(layer(x)) < 2e-4  # int16 activations (the default): 2e-5 to 6e-5 here
        # int8 ones (q4_1 only; the other kinds keep int16): 3e-3 to 4e-3 here
        assert error(coarse(x)) < (6e-3 if kind == "q4_1" else 2e-4)


def _row_major_product(layer: GGMLLinear, x: torch.Tensor) -> torch.Tensor:
    """ggml_linear without the interleaved copy: ggml_gemv.c's row-at-a-time kernel at any row count."""
    y = torch.empty(x.shape[0], layer.out_features)
    assert kernels().ggml_linear(*layer.planes(), None, None, None, layer.out_features, layer.in_features,
                                 x.shape[0], x.data_ptr(), y.data_ptr()) == 0
    return y


def _int8_reference(planes: Planes, x: torch.Tensor) -> torch.Tensor:
    """A Q4_1 product as ggml_gemm_x8.c computes it, in float64 from the same int8 codes: per
    block d d8 sum(q q8) + m s + 8 d e8 (ggml_gemv.h's qacts)."""
    acts = quantize_activations(x)
    rows, blocks = x.shape[0], x.shape[1] // 32
    q8 = acts["q8"].view(rows, blocks, 32).double()
    codes = planes.codes.view(planes.codes.shape[0], blocks, 32).double()
    d, m = planes.scales.double(), planes.offsets.double()
    dots = torch.einsum("rbi,obi->rob", q8, codes)
    view = lambda name: acts[name].view(rows, 1, blocks).double()  # noqa: E731
    return (d * (dots * view("d8") + 8 * view("e8")) + m * view("s")).sum(-1).float()


@pytest.mark.parametrize("kind,activations", [("q4_1", "int16"), ("q4_1", "int8"), ("q8_0", "int8"),
                                               ("q6_k", "int8")])
# a whole last group of eight outputs; a part of one, paired with a whole one in AVX-512's sixteen lanes (93)
# and alone (101)
@pytest.mark.parametrize("out_features", [93, 96, 101])
def test_the_interleaved_kernel_equals_its_integer_reference(kind, activations, out_features):
    """Both are exact integer dot products per block, scaled in fp32: they differ only in the order
    of float additions. On int16 codes (Q8_0 and Q6_K always) the reference is the row-major
    kernel; Q4_1 on int8 codes is checked against its arithmetic done in float64. Any slip in the
    interleaving (a lane, a pair, a nibble, a q6_k half, the tail group, a tail tile or a second
    chunk of rows) is off by a whole weight."""
    planes = random_planes(kind, out_features, 160, np.random.default_rng(5))
    layer = GGMLLinear(planes, activations)
    for rows in (1, 4, 5, 6, 7, 8, 9, 15, 16, 67):  # AVX2 tiles 6 rows, AVX-512 VNNI 8
        x = torch.randn(rows, 160)
        on_int8 = kind == "q4_1" and activations == "int8"
        expected = _int8_reference(planes, x) if on_int8 else _row_major_product(layer, x)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def isas_here() -> list[str]:
    """The kernels' instruction sets this machine can run."""
    here = []
    for isa in KERNEL_ISAS:
        try:
            with using_kernel_isa(isa):
                here.append(isa)
        except KvlabEnvironmentError:
            pass
    return here


@pytest.mark.parametrize("kind,activations", [("q4_1", "int16"), ("q4_1", "int8"), ("q8_0", "int16"),
                                               ("q6_k", "int16")])
@pytest.mark.parametrize("out_features", [93, 101])  # a partial last group in a pair of groups, and alone
def test_every_instruction_set_gives_the_same_bits(kind, activations, out_features):
    """AVX2 (madd, then add) and AVX-512 VNNI (one vpdpwssd / vpdpbusd, two groups per vector) form
    the same int32 sums, and the float steps after them are the same per lane: outputs must be
    identical, not close, at every tile and remainder of either (6 and 8 rows) and across a
    second chunk of rows."""
    here = isas_here()
    if len(here) < 2:
        pytest.skip(f"this CPU runs only {here}: nothing to compare")
    planes = random_planes(kind, out_features, 160, np.random.default_rng(8))
    layer = GGMLLinear(planes, activations)
    for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 17, 70):
        x = torch.randn(rows, 160)
        outputs = []
        for isa in here:
            with using_kernel_isa(isa):
                outputs.append(layer(x))
        for other in outputs[1:]:
            assert torch.equal(outputs[0], other), rows


def test_the_instruction_set_is_reported_and_pinned():
    assert kernel_isa() in KERNEL_ISAS
    with using_kernel_isa("avx2"):  # every machine the kernels load on has AVX2
        assert kernel_isa() == "avx2"
        assert fp8_attention_isa() == "avx2"  # fp8's AVX-512 unit follows the pin
    if "avx512_vnni" in isas_here():
        with using_kernel_isa("avx512_vnni"):
            assert fp8_attention_isa() == ("avx512_vbmi" if kernels().fp8_vbmi_usable() else "avx2")
    with pytest.raises(ValueError):
        with using_kernel_isa("sse2"):
            pass


def test_the_int8_reference_tells_a_slipped_nibble():
    """The check above can fail: one weight's code changed in the planes, not in the kernel's copy."""
    planes = random_planes("q4_1", 96, 160, np.random.default_rng(5))
    layer = GGMLLinear(planes, "int8")
    x = torch.randn(3, 160)
    assert torch.allclose(layer(x), _int8_reference(planes, x), rtol=1e-5, atol=1e-5)
    slipped = Planes("q4_1", planes.codes.clone(), planes.scales, planes.offsets)
    slipped.codes[17, 40] = (slipped.codes[17, 40] + 1) % 16
    assert not torch.allclose(layer(x), _int8_reference(slipped, x), rtol=1e-5, atol=1e-5)


def test_stacked_planes_compute_as_their_parts():
    rng = np.random.default_rng(4)
    parts = [random_planes("q4_1", rows, 64, rng) for rows in (32, 16, 16)]
    x = torch.randn(2, 64)
    stacked = GGMLLinear(stack_planes(parts))(x)
    torch.testing.assert_close(stacked, torch.cat([GGMLLinear(part)(x) for part in parts], dim=-1))
    with pytest.raises(ValueError, match="one kind"):
        stack_planes([parts[0], random_planes("q8_0", 16, 64, rng)])


def test_a_bf16_model_keeps_the_fp32_planes():
    """model.to(torch.bfloat16) must not narrow the scales the C kernels read as fp32."""
    layer = GGMLLinear(random_planes("q4_1", 32, 64, np.random.default_rng(3)))
    x = torch.randn(2, 64).bfloat16()
    expected = layer(x.float())
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == layer.offsets.dtype == torch.float32
    torch.testing.assert_close(layer(x).float(), expected, rtol=0, atol=0.02 * expected.abs().max().item())


def test_shape_and_dtype_follow_the_input():
    planes = random_planes("q4_1", 32, 64, np.random.default_rng(1))
    y = GGMLLinear(planes)(torch.randn(2, 1, 64, dtype=torch.float64))
    assert y.shape == (2, 1, 32) and y.dtype == torch.float64


def test_bad_planes_are_refused():
    planes = random_planes("q4_1", 32, 64, np.random.default_rng(2))
    with pytest.raises(ValueError, match="do not describe one matrix"):
        GGMLLinear(Planes("q4_1", planes.codes, planes.scales[:, :1], planes.offsets))
    with pytest.raises(ValueError, match="do not describe one matrix"):
        GGMLLinear(Planes("q8_0", planes.codes.to(torch.int8), planes.scales, planes.offsets))
    with pytest.raises(ValueError, match="unsupported planes kind"):
        GGMLLinear(Planes("q5_k", planes.codes, planes.scales))


@pytest.mark.parametrize("kind", sorted(GROUP))
def test_packed_planes_are_taken_as_they_are(kind):
    """GGMLLinear keeps a PackedPlanes' own tensors (no copy) and decodes them as the Planes they came from."""
    planes = random_planes(kind, 32, 64, np.random.default_rng(5))
    packed = planes.packed()
    layer = GGMLLinear(packed)
    assert layer.codes is packed.codes and layer.scales is packed.scales and layer.offsets is packed.offsets
    assert torch.equal(layer.weight, planes.dense())
    assert (packed.codes.shape[1], packed.codes.dtype) == ((32, torch.uint8) if kind == "q4_1" else (64, torch.int8))


def test_bad_packed_planes_are_refused():
    packed = random_planes("q4_1", 32, 64, np.random.default_rng(6)).packed()
    for bad in (PackedPlanes("q4_1", 64, packed.codes[:, :16], packed.scales, packed.offsets),  # half the codes
                PackedPlanes("q4_1", 64, packed.codes.to(torch.int8), packed.scales, packed.offsets),
                PackedPlanes("q4_1", 64, packed.codes, packed.scales.double(), packed.offsets),
                PackedPlanes("q4_1", 64, packed.codes, packed.scales, None),
                PackedPlanes("q4_1", 64, packed.codes.t().contiguous().t(), packed.scales, packed.offsets)):
        with pytest.raises(ValueError, match="do not describe one"):
            GGMLLinear(bad)


def test_activation_quantiser_is_round_half_even_per_block():
    """quantize_act (eight lanes at a time, blocks shared out over threads) gives, per 32 values,
    the codes of round-half-even(x / (amax / 32767)) with that scale, those of
    round-half-even(x / (amax / 127)) with theirs, each block's sum, and the sum's error under
    the int8 codes: exact ties, an all-zero block, a block whose largest value is negative, and a
    tail of blocks each thread would own."""
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal(32 * 37).astype(np.float32)) * 3
    x[32:64] = 0.0  # a zero block: scale 0, codes 0
    x[64:96] = torch.arange(32, dtype=torch.float32) - 40.0  # amax from a negative value
    x[96] = 32767 * 0.5 / 32767  # the block's other values sit on exact halves of its step below
    x[97:128] = torch.tensor([0.5 * (2 * i + 1) / 32767 for i in range(31)], dtype=torch.float32) * x[96] * 2
    x[128] = 127 * 0.5 / 127  # ... and on exact halves of the int8 step in the next block
    x[129:160] = torch.tensor([0.5 * (2 * i + 1) / 127 for i in range(31)], dtype=torch.float32) * x[128] * 2
    got = quantize_activations(x)
    blocks = x.view(-1, 32)
    for codes, scales, top, dtype in ((got["q"], got["d"], 32767.0, torch.int16), (got["q8"], got["d8"], 127.0,
                                                                                    torch.int8)):
        scale = blocks.abs().amax(dim=1) / top
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        expected = torch.round(blocks * inverse[:, None]).to(dtype)  # torch.round: half to even
        assert torch.equal(scales, scale)
        assert torch.equal(codes.view(-1, 32), expected)
        assert torch.equal(codes[32:64], torch.zeros(32, dtype=dtype))
    torch.testing.assert_close(got["s"], blocks.sum(dim=1), rtol=1e-6, atol=1e-5)
    represented = got["d8"] * got["q8"].view(-1, 32).sum(dim=1).float()
    slack = 1e-6 * (got["s"].abs() + represented.abs()) + 1e-7  # fp32 rounding of the subtraction
    assert ((got["e8"] - (got["s"] - represented)).abs() <= slack).all()
    assert got["e8"].abs().max() > 0  # the int8 codes do lose something


def test_products_past_the_crossover_run_in_the_library_on_the_exact_weights(monkeypatch):
    """The library backend multiplies by the blocks' exact dense copy: in fp32 (AVX2 machines) no
    int16 rounding of the activations, so it matches the dense product to fp32 noise; in bf16
    (matrix engines) to bf16's rounding. One row stays in C whatever the setting."""
    from kvlab.nn.matmul_backend import library_dtype

    planes = random_planes("q4_1", 96, 160, np.random.default_rng(6))
    layer, dense = GGMLLinear(planes), planes.dense()
    x = torch.randn(32, 160)
    expected = x @ dense.t()
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "library")
    tolerance = 1e-6 if library_dtype() == torch.float32 else 1e-2
    assert (layer(x) - expected).norm() / expected.norm() < tolerance
    assert layer.library_weight() is layer.library_weight()  # made once
    one = layer(x[:1])
    monkeypatch.setenv("KVLAB_MATMUL_BACKEND", "kernels")
    assert 1e-6 < (layer(x) - expected).norm() / expected.norm() < 2e-4  # the int16 kernel's rounding
    assert torch.equal(layer(x[:1]), one)
