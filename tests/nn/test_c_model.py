"""The C step on the lab's rows (kvlab.cache.PooledRows: the contiguous cache as a pool with one
block per row) against the module-by-module path on the lab's reference caches."""

import pytest
import torch

from kvlab.cache.pooled_rows import PooledRows
from kvlab.nn.config import ModelConfig
from kvlab.nn.generate import generate
from kvlab.nn.ggml import GROUP, GGMLLinear, Planes
from kvlab.nn.kernels import kernels
from kvlab.nn.model import Decoder
from kvlab.nn.paged_decode import PagedDecodeStep

from needs import require_kernels

pytestmark = pytest.mark.usefixtures("kernels_lib")


@pytest.fixture(autouse=True, scope="module")
def kernels_lib():
    return require_kernels()

GQA = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64,
                  tie_embeddings=True, name="gqa")
CONFIGS = [GQA, GQA.with_kv_heads(1), GQA.with_kv_heads(4),
           ModelConfig(**{**GQA.to_dict(), "rope_style": "interleaved", "n_layers": 3, "name": "interleaved"})]


def planes_of(weight: torch.Tensor, kind: str) -> Planes:
    """`weight` [out, in] rounded to planes of `kind`: q4_1 (min/max per 32), q8_0 or q6_k (absmax)."""
    groups = weight.detach().float().reshape(weight.shape[0], -1, GROUP[kind])
    if kind == "q4_1":
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scales = ((high - low) / 15).clamp_min(1e-8)
        codes = ((groups - low) / scales).round().clamp(0, 15).to(torch.uint8)
        return Planes(kind, codes.reshape(weight.shape), scales.squeeze(-1), low.squeeze(-1))
    top = 127 if kind == "q8_0" else 31
    scales = (groups.abs().amax(-1, keepdim=True) / top).clamp_min(1e-8)
    codes = (groups / scales).round().clamp(-top - 1, top).to(torch.int8)
    return Planes(kind, codes.reshape(weight.shape), scales.squeeze(-1))


# How far two paths' logits (and K/V) may sit apart, as a fraction of their largest, by the
# precision activations are quantised to per 32 values before each product (ggml_gemv.h's
# qacts). Where the paths' float summation orders (norms, softmax) put a value on the other
# side of a rounding boundary, its code moves a whole step, amax / 32767 or amax / 127 of its
# block. int16: scaling the embeddings by 1 + 1e-7 moves the module path's own logits by up to
# 1.2e-4 of their largest. int8 (Q4_1 layers only): a tipped code moves them by 1e-3 to 9e-3,
# none tipped by 2e-5 to 6e-5 (every comparison in this file and test_paged_decode.py). A wrong
# RoPE pair, head mapping or cache slot moves them by tenths.
TOLERANCE = {"int16": 1e-3, "int8": 2e-2}


def assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor, activations: str = "int16") -> None:
    """Equal up to float summation order and the activation codes it tips (TOLERANCE)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[activations] * expected.abs().max().item())


def ggml_model(config: ModelConfig, seed: int = 0, activations: str = "int16") -> Decoder:
    """A random decoder whose matrices are GGMLLinear planes, the three kinds taking turns;
    `activations` for its Q4_1 layers."""
    torch.manual_seed(seed)
    model = Decoder(config).eval()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)  # peaked logits: greedy ties are impossible
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for index, name in enumerate(names):
        linear = model.get_submodule(name)
        kind = sorted(GROUP)[index % len(GROUP)]
        model.set_submodule(name, GGMLLinear(planes_of(linear.weight, kind), activations))
    return model


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.name}-kv{c.kv_heads}")
@pytest.mark.parametrize("batch", [1, 2, 5])  # 5: a 4-row tile and one row
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_c_steps_on_the_lab_rows_equal_module_steps(config, batch, activations):
    check_against_module_steps(config, batch, "auto", activations=activations)


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "bf16"])
def test_half_precision_caches_equal_module_steps(kv_cache_dtype):
    check_against_module_steps(GQA, 2, kv_cache_dtype)


def test_long_contexts_split_attention_into_chunks():
    """Past 128 tokens attention runs in chunks whose softmax partials are merged (flash-decoding)."""
    config = ModelConfig(**{**GQA.to_dict(), "max_seq_len": 512, "name": "long"})
    check_against_module_steps(config, 1, "auto", prompt_len=301, steps=6)  # 3 chunks, partly filled


def c_step(model: Decoder, rows: PooledRows, ids: torch.Tensor) -> torch.Tensor:
    """One decode step of every row in C."""
    logits = PagedDecodeStep(model, rows.pool, rows.batch)(ids, rows.step(1))
    rows.advance(1)
    return logits


def check_against_module_steps(config: ModelConfig, batch: int, kv_cache_dtype: str, prompt_len: int = 5,
                               steps: int = 20, activations: str = "int16") -> None:
    model = ggml_model(config, activations=activations)
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    total = prompt_len + steps + 5
    reference, rows = model.reference_cache(batch, total, kv_cache_dtype), model.new_cache(batch, total, kv_cache_dtype)
    assert isinstance(rows, PooledRows) and rows.pool.num_blocks == batch  # one block of `total` tokens per row
    with torch.inference_mode():
        ids = model(prompt, reference, last_only=True)[:, -1].argmax(-1)
        model(prompt, rows, last_only=True)
        for _ in range(steps):
            expected = model(ids[:, None], reference, last_only=True)[:, -1]
            got = c_step(model, rows, ids)
            assert_close_to_scale(got, expected, activations)
            ids = expected.argmax(-1)
    assert rows.seq_len() == reference.seq_len(config.n_layers - 1) == prompt_len + steps
    for layer in range(config.n_layers):
        for ours, theirs in zip(rows.pool.float_planes(layer), reference.float_buffers(layer)):
            ours = ours[:, :, :rows.seq_len()].transpose(0, 1).transpose(1, 0)  # [rows, heads, tokens, dim]
            theirs = theirs[:, :, :rows.seq_len()]
            assert ours.dtype == theirs.dtype == {"auto": torch.float32, "fp16": torch.float16,
                                                  "bf16": torch.bfloat16}[kv_cache_dtype]
            # the keys and values written: as close as the logits, or one step of the cache's dtype
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=torch.finfo(ours.dtype).eps,
                                       atol=TOLERANCE[activations] * theirs.abs().max().item())
            if ours.dtype != torch.float32:  # rounded to nearest as torch rounds, not truncated
                shrunk = (ours.float().abs() < theirs.float().abs()).float().mean().item()
                grown = (ours.float().abs() > theirs.float().abs()).float().mean().item()
                assert abs(shrunk - grown) < 0.1, (shrunk, grown)  # truncating shrinks about half


def test_generate_uses_the_c_step_and_agrees_with_the_module_path():
    model = ggml_model(GQA)
    prompts = torch.tensor([[1, 2, 3], [9, 8, 7]])
    stats_fused, stats_modules = {}, {}
    fused = generate(model, prompts, 24, stats=stats_fused)
    modules = generate(model, prompts, 24, stats=stats_modules, paged_step=False)
    assert stats_fused["paged_step"] and not stats_modules["paged_step"]
    assert torch.equal(fused, modules)


def test_the_module_path_carries_on_from_c_steps():
    model = ggml_model(GQA)
    prompt = torch.tensor([[4, 5, 6]])
    mixed, reference = model.new_cache(1, 12), model.reference_cache(1, 12)
    with torch.inference_mode():
        ids = model(prompt, mixed, last_only=True)[:, -1].argmax(-1)
        model(prompt, reference, last_only=True)
        for index in range(8):
            expected = model(ids[:, None], reference, last_only=True)[:, -1]
            got = c_step(model, mixed, ids) if index % 2 else model(ids[:, None], mixed, last_only=True)[:, -1]
            assert_close_to_scale(got, expected)
            ids = expected.argmax(-1)


def test_full_rows_are_refused_not_overrun():
    model = ggml_model(GQA)
    rows = model.new_cache(1, 4)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), rows)
        c_step(model, rows, torch.tensor([4]))
        with pytest.raises(Exception, match="over their capacity of 4"):
            c_step(model, rows, torch.tensor([5]))
    assert rows.seq_len() == 4


def test_the_vector_exp_is_as_close_as_expf():
    """Attention's softmax uses an 8-lane e^x (scores minus their maximum, so x <= 0)."""
    x = torch.cat([-torch.rand(100_003, generator=torch.Generator().manual_seed(0)) * 87, torch.zeros(5)])
    y = torch.empty_like(x)
    kernels().exp_nonpositive(x.data_ptr(), y.data_ptr(), x.numel())
    exact = torch.exp(x.double())
    assert ((y.double() - exact).abs() / exact).max().item() < 2 * torch.finfo(torch.float32).eps  # measured 1.1e-7
    assert torch.equal(y[-5:], torch.ones(5))
