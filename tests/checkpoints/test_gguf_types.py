"""Every GGUF tensor type the loader reads gives the weights its F32 twin gives.

A tiny Llama is written twice: once with each matrix in a different stored type (F16, Q8_0,
Q4_1, Q5_0, Q4_K, Q6_K), once all F32 holding exactly what those blocks decode to. The
loader must build the same model from both (shapes reversed, Q/K rows un-permuted, fused
matrices stacked the same way, whatever the type), and the block-computing packing must
agree with it.
"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from kvlab.checkpoints.gguf import config_from_gguf, load_weights, read_gguf  # noqa: E402
from kvlab.nn.ggml import GGMLLinear, kernels  # noqa: E402
from kvlab.nn.model import Decoder  # noqa: E402

DIM, FFN, VOCAB, HEADS, KV_HEADS, LAYERS = 256, 512, 64, 4, 2, 2  # K-quant blocks hold 256 weights
MATRIX_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q6_K, "attn_v": T.Q5_0, "attn_output": T.F16,
                "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0}
K_BLOCK = {T.Q4_K: 144, T.Q6_K: 210}  # bytes per 256 weights


def random_k_blocks(kind: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes with sane fp16 super-block scales (gguf-py cannot quantise K-quants)."""
    raw = rng.integers(0, 256, (rows, cols // 256, K_BLOCK[kind]), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    if kind == T.Q4_K:  # d and dmin lead the block
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d ends it
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def stored(kind: T, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array as written, the fp32 values they decode to) for a [rows, cols] matrix."""
    if kind in K_BLOCK:
        raw = random_k_blocks(kind, rows, cols, rng)
        return raw, quants.dequantize(raw, kind).astype(np.float32)
    values = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
    if kind == T.F16:
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
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
    for name, values in {"token_embd.weight": rng.normal(0, 1, (VOCAB, DIM)),
                         "output_norm.weight": rng.uniform(0.5, 1.5, DIM)}.items():
        typed[name] = plain[name] = (T.F32, values.astype(np.float32))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            typed[f"blk.{layer}.{norm}.weight"] = plain[f"blk.{layer}.{norm}.weight"] = (
                T.F32, rng.uniform(0.5, 1.5, DIM).astype(np.float32))
        for name, kind in MATRIX_TYPES.items():
            data, decoded = stored(kind, *shapes[name], rng)
            typed[f"blk.{layer}.{name}.weight"] = (kind, data)
            plain[f"blk.{layer}.{name}.weight"] = (T.F32, decoded)
    folder = tmp_path_factory.mktemp("gguf-types")
    return write(folder / "typed.gguf", typed), write(folder / "plain.gguf", plain)


def build(path: str, packing: str) -> Decoder:
    file = read_gguf(path)
    config = config_from_gguf(file.meta, VOCAB, tied=True)
    state, modules = load_weights(file, config, packing)
    return Decoder.from_state_dict(config, state, modules).eval()


def test_every_type_loads_as_its_f32_twin(twin_files):
    typed, plain = twin_files
    stored_types = {t.tensor_type for t in read_gguf(typed).tensors.values()}
    assert {T.F16, T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K} <= stored_types
    ours, reference = build(typed, "dense").state_dict(), build(plain, "dense").state_dict()
    assert ours.keys() == reference.keys()
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name


@pytest.mark.skipif(kernels() is None, reason="no C compiler or no AVX2 here")
def test_block_packing_keeps_q4_1_and_q8_0_and_agrees(twin_files):
    typed, _ = twin_files
    dense, packed = build(typed, "dense"), build(typed, "gguf")
    kept = {name for name, module in packed.named_modules() if isinstance(module, GGMLLinear)}
    assert kept == {f"blocks.{i}.{m}" for i in range(LAYERS) for m in ("mlp.gate_up", "mlp.down")}
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        expected, got = dense(ids), packed(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3 * expected.abs().max().item())
