"""Every GGUF tensor type the loader reads gives the weights its F32 twin gives.

A tiny Llama is written twice: once with its tensors in different stored types (F16 norms,
Q4_K/Q6_K/Q5_0 queries/keys/values as in llama.cpp's Q4_K_M mixes, Q4_0, Q4_1, Q8_0), once all
F32 holding exactly what those blocks decode to. The loader must build the same model from
both (shapes reversed, Q/K rows un-permuted, fused matrices stacked the same way, whatever the
type). The block-computing packing must keep every matrix as planes, decoding to the same
weights, and its fused decode step must run on the mixed stacks.
"""

import numpy as np
import pytest
import torch

from needs import require_kernels, require_module

gguf = require_module("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from kvlab.checkpoints.gguf import (LAYER_MATRICES, _rows, config_from_gguf, load_weights, planes_of,  # noqa: E402
                                    read_gguf)
from kvlab.checkpoints.gguf_planes import packed_from_blocks, planes_from_blocks, stack_packed  # noqa: E402
from kvlab.nn.generate import generate  # noqa: E402
from kvlab.nn.ggml import GGMLLinear, GGMLStack, PackedPlanes, ggml_layer, stack_planes  # noqa: E402
from kvlab.nn.model import Decoder  # noqa: E402

DIM, FFN, VOCAB, HEADS, KV_HEADS, LAYERS = 256, 512, 64, 4, 2, 2  # K-quant blocks hold 256 weights
MATRIX_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_0,
                "ffn_gate": T.Q5_0, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0}
K_BLOCK = {T.Q4_K: 144, T.Q6_K: 210}  # bytes per 256 weights


def random_k_blocks(kind: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes with sane fp16 super-block scales (gguf-py cannot quantise K-quants)."""
    raw = rng.integers(0, 256, (rows, cols // 256, K_BLOCK[kind]), dtype=np.uint8)
    # weights of a few tenths at most, like a trained model's: larger ones make attention chaotic
    scale = np.array([5e-4 if kind == T.Q4_K else 1e-4], dtype=np.float16).view(np.uint8)
    if kind == T.Q4_K:  # d and dmin lead the block
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d ends it
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def stored(kind: T, rows: int, cols: int, rng: np.random.Generator, std: float = 0.05
           ) -> tuple[np.ndarray, np.ndarray]:
    """(blocks as written, the fp32 values they decode to) for a [rows, cols] matrix."""
    if kind in K_BLOCK:
        raw = random_k_blocks(kind, rows, cols, rng)
        return raw, quants.dequantize(raw, kind).astype(np.float32)
    values = rng.normal(0, std, (rows, cols)).astype(np.float32)
    raw = quants.quantize(values, kind)
    return raw, quants.dequantize(raw, kind).astype(np.float32)


def write(path, tensors: dict[str, tuple[T, np.ndarray]]) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"context_length": 64, "embedding_length": DIM, "block_count": LAYERS,
                       "feed_forward_length": FFN, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for name, (kind, data) in tensors.items():
        if kind in (T.F32, T.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def twin_files(tmp_path_factory):
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (DIM, DIM), "attn_k": (DIM // HEADS * KV_HEADS, DIM), "attn_v": (DIM // HEADS * KV_HEADS, DIM),
              "attn_output": (DIM, DIM), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM), "ffn_down": (DIM, FFN)}
    typed, plain = {}, {}
    data, decoded = stored(T.Q8_0, VOCAB, DIM, rng, std=1.0)  # the tied LM head too
    typed["token_embd.weight"], plain["token_embd.weight"] = (T.Q8_0, data), (T.F32, decoded)
    typed["output_norm.weight"] = plain["output_norm.weight"] = (T.F32, rng.uniform(0.5, 1.5, DIM).astype(np.float32))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            half = rng.uniform(0.5, 1.5, DIM).astype(np.float16)
            typed[f"blk.{layer}.{norm}.weight"] = (T.F16, half)
            plain[f"blk.{layer}.{norm}.weight"] = (T.F32, half.astype(np.float32))
        for name, kind in MATRIX_TYPES.items():
            data, decoded = stored(kind, *shapes[name], rng)
            typed[f"blk.{layer}.{name}.weight"] = (kind, data)
            plain[f"blk.{layer}.{name}.weight"] = (T.F32, decoded)
    folder = tmp_path_factory.mktemp("gguf-types")
    return write(folder / "typed.gguf", typed), write(folder / "plain.gguf", plain)


def build(path: str, packing: str) -> Decoder:
    file = read_gguf(path)
    config = config_from_gguf(file.header)
    state, modules = load_weights(file, config, packing)
    return Decoder.from_state_dict(config, state, modules).eval()


def test_every_type_loads_as_its_f32_twin(twin_files):
    typed, plain = twin_files
    stored_types = {t.tensor_type for t in read_gguf(typed).tensors.values()}
    assert {T.F16, T.Q4_0, T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K} <= stored_types
    ours, reference = build(typed, "dense").state_dict(), build(plain, "dense").state_dict()
    assert ours.keys() == reference.keys()
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name


def test_block_packing_keeps_every_matrix_and_fuses_mixed_stacks(twin_files):
    require_kernels()
    typed, _ = twin_files
    dense, packed = build(typed, "dense"), build(typed, "gguf")
    kinds = {name: module.kind for name, module in packed.named_modules() if isinstance(module, GGMLLinear)}
    for i in range(LAYERS):  # Q and K (Q4_K) share planes; V (Q6_K) sits beside them in a GGMLStack
        assert isinstance(packed.blocks[i].attn.qkv, GGMLStack)
        assert [kinds[f"blocks.{i}.attn.qkv.parts.{p}"] for p in (0, 1)] == ["q4_1", "q6_k"]
        assert [kinds[f"blocks.{i}.{m}"] for m in ("attn.o", "mlp.down")] == ["q4_1", "q8_0"]
        assert isinstance(packed.blocks[i].mlp.gate_up, GGMLStack)  # Q5_0 gate (q8_0) beside Q4_1 up
    assert kinds["lm_head"] == "q8_0"
    assert torch.equal(packed.embed.weight, dense.embed.weight)  # the tied table, decoded in C from the head
    for name, module in packed.named_modules():
        if isinstance(module, (GGMLLinear, GGMLStack)) and ".parts." not in name:
            assert torch.equal(module.weight, dense.get_submodule(name).weight), name
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        expected, got = dense(ids), packed(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3 * expected.abs().max().item())
    stats = {}
    fused = generate(packed, [1, 5, 9, 2], 12, stats=stats)
    assert stats["paged_step"]
    assert torch.equal(fused, generate(packed, [1, 5, 9, 2], 12, paged_step=False))


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q8_0, T.Q6_K])
def test_planes_decode_exactly_as_gguf(kind):
    data, decoded = stored(kind, 8, 512, np.random.default_rng(5))
    planes = planes_from_blocks(data, kind.name, 512)
    assert torch.equal(planes.dense(), torch.from_numpy(decoded))


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q8_0, T.Q6_K])
def test_kernels_read_the_planes_as_gguf_decodes_them(kind):
    require_kernels()
    data, decoded = stored(kind, 8, 512, np.random.default_rng(5))
    planes = planes_from_blocks(data, kind.name, 512)
    assert torch.equal(GGMLLinear(planes).weight, torch.from_numpy(decoded))


ALL_KINDS = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q8_0, T.Q6_K]


def assert_same_buffers(new: PackedPlanes, old: PackedPlanes) -> None:
    assert (new.kind, new.cols) == (old.kind, old.cols)
    for mine, theirs in ((new.codes, old.codes), (new.scales, old.scales), (new.offsets, old.offsets)):
        assert (mine is None) == (theirs is None)
        if theirs is not None:
            assert mine.dtype == theirs.dtype and mine.is_contiguous() and torch.equal(mine, theirs)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_packing_straight_from_the_blocks_equals_packing_the_planes(kind):
    """The loader's route (blocks straight into the kernels' layout, rows taken in a permuted
    order, two matrices written into one stack) holds the very codes, scales and offsets that
    unpacking to natural-order planes, permuting, concatenating and repacking gave."""
    rng = np.random.default_rng(7)
    (first, _), (second, _) = stored(kind, 16, 512, rng), stored(kind, 8, 512, rng)
    order = rng.permutation(16)
    old = stack_planes([planes_from_blocks(first, kind.name, 512).map_rows(lambda t: t[torch.from_numpy(order)]),
                        planes_from_blocks(second, kind.name, 512)]).packed()
    new = stack_packed([packed_from_blocks(first, kind.name, 512).take_rows(order),
                        packed_from_blocks(second, kind.name, 512)])
    assert_same_buffers(new, old)


def test_every_loaded_layer_holds_what_the_planes_route_gave(twin_files):
    """Whole-model check on the mixed file: every GGMLLinear the loader builds (Q/K rows
    un-permuted, mixed-kind stacks, the tied head) has the buffers of the former route."""
    require_kernels()
    typed, _ = twin_files
    file = read_gguf(typed)
    config = config_from_gguf(file.header)
    _, modules = load_weights(file, config, "gguf")
    assert len(modules) == 1 + 4 * LAYERS
    for name, module in modules.items():
        if name == "lm_head":
            names, parts = ["token_embd.weight"], ["token_embd"]
        else:
            _, layer, ours = name.split(".", 2)
            parts = list(LAYER_MATRICES[ours])
            names = [f"blk.{layer}.{part}.weight" for part in parts]
        old = ggml_layer([planes_of(file.tensors[n]).map_rows(_rows(p, config)) for n, p in zip(names, parts)])
        mine = list(module.parts) if isinstance(module, GGMLStack) else [module]
        theirs = list(old.parts) if isinstance(old, GGMLStack) else [old]
        assert len(mine) == len(theirs), name
        for a, b in zip(mine, theirs):
            assert (a.kind, a.in_features, a.out_features) == (b.kind, b.in_features, b.out_features), name
            for buffer in ("codes", "scales", "offsets"):
                x, y = getattr(a, buffer), getattr(b, buffer)
                assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), (name, buffer)
