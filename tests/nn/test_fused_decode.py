"""The fused decode step (one C call per token) against the module-by-module path it replaces."""

import pytest
import torch

from kvlab.cache import make_cache
from kvlab.cache.base import KVShape
from kvlab.cache.codecs import FloatCodec
from kvlab.cache.contiguous import ContiguousCache
from kvlab.nn.config import ModelConfig
from kvlab.nn.fused_decode import FusedDecodeStep, fused_step_for, why_not_fused
from kvlab.nn.generate import generate
from kvlab.nn.ggml import GROUP, GGMLLinear, Planes
from kvlab.nn.kernels import kernels
from kvlab.nn.model import Decoder

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
def test_fused_steps_equal_module_steps(config, batch, activations):
    check_against_module_steps(config, batch, "auto", activations=activations)


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "bf16"])
def test_half_precision_caches_equal_module_steps(kv_cache_dtype):
    check_against_module_steps(GQA, 2, kv_cache_dtype)


def test_long_contexts_split_attention_into_chunks():
    """Past 128 tokens attention runs in chunks whose softmax partials are merged (flash-decoding)."""
    config = ModelConfig(**{**GQA.to_dict(), "max_seq_len": 512, "name": "long"})
    check_against_module_steps(config, 1, "auto", prompt_len=301, steps=6)  # 3 chunks, partly filled


def check_against_module_steps(config: ModelConfig, batch: int, kv_cache_dtype: str, prompt_len: int = 5,
                               steps: int = 20, activations: str = "int16") -> None:
    model = ggml_model(config, activations=activations)
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    total = prompt_len + steps + 5
    reference, cache = model.new_cache(batch, total, kv_cache_dtype), model.new_cache(batch, total, kv_cache_dtype)
    with torch.inference_mode():
        ids = model(prompt, reference, last_only=True)[:, -1].argmax(-1)
        model(prompt, cache, last_only=True)
        step = FusedDecodeStep(model, cache)
        for _ in range(steps):
            expected = model(ids[:, None], reference, last_only=True)[:, -1]
            got = step(ids)
            assert_close_to_scale(got, expected, activations)
            ids = expected.argmax(-1)
    assert cache.seq_len(0) == reference.seq_len(config.n_layers - 1) == prompt_len + steps
    for layer in range(config.n_layers):
        for ours, theirs in zip(cache.float_buffers(layer), reference.float_buffers(layer)):
            assert ours.dtype == theirs.dtype == {"auto": torch.float32, "fp16": torch.float16,
                                                  "bf16": torch.bfloat16}[kv_cache_dtype]
            # the keys and values written: as close as the logits, or one step of the cache's dtype
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=torch.finfo(ours.dtype).eps,
                                       atol=TOLERANCE[activations] * theirs.abs().max().item())
            if ours.dtype != torch.float32:  # rounded to nearest as torch rounds, not truncated
                shrunk = (ours.float().abs() < theirs.float().abs()).float().mean().item()
                grown = (ours.float().abs() > theirs.float().abs()).float().mean().item()
                assert abs(shrunk - grown) < 0.1, (shrunk, grown)  # truncating shrinks about half


def test_generate_uses_the_fused_step_and_agrees_with_the_module_path():
    model = ggml_model(GQA)
    prompts = torch.tensor([[1, 2, 3], [9, 8, 7]])
    stats_fused, stats_modules = {}, {}
    fused = generate(model, prompts, 24, stats=stats_fused)
    modules = generate(model, prompts, 24, stats=stats_modules, fused=False)
    assert stats_fused["fused_decode"] and not stats_modules["fused_decode"]
    assert torch.equal(fused, modules)


def test_the_module_path_carries_on_from_fused_steps():
    model = ggml_model(GQA)
    prompt = torch.tensor([[4, 5, 6]])
    mixed, reference = model.new_cache(1, 12), model.new_cache(1, 12)
    with torch.inference_mode():
        ids = model(prompt, mixed, last_only=True)[:, -1].argmax(-1)
        model(prompt, reference, last_only=True)
        step = FusedDecodeStep(model, mixed)
        for index in range(8):
            expected = model(ids[:, None], reference, last_only=True)[:, -1]
            got = step(ids) if index % 2 else model(ids[:, None], mixed, last_only=True)[:, -1]
            assert_close_to_scale(got, expected)
            ids = expected.argmax(-1)


def test_a_full_cache_is_refused_not_overrun():
    model = ggml_model(GQA)
    cache = model.new_cache(1, 4)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache)
        step = FusedDecodeStep(model, cache)
        step(torch.tensor([4]))
        with pytest.raises(ValueError, match="beyond the cache's 4 tokens"):
            step(torch.tensor([5]))
    assert cache.seq_len(0) == 4


@pytest.mark.parametrize("change,reason", [
    (lambda model: (Decoder(GQA), model.new_cache(1, 8)), "held as GGUF blocks"),
    (lambda model: (model, model.new_cache(1, 8, "fp8")), "fp32/fp16/bf16 CPU cache"),
    (lambda model: (model, model.new_cache(1, 8, "int8")), "fp32/fp16/bf16 CPU cache"),
    (lambda model: (model, model.new_cache(1, 8, paged=True)), "fp32/fp16/bf16 CPU cache"),
    (lambda model: (model, model.new_cache(1, 8, pre_rope=True)), "pre-RoPE"),
    (lambda model: (model, make_cache("auto", GQA.n_layers, 1, 1, 16, 16, 8)), "KV heads and head dim"),
    (lambda model: (model, ContiguousCache(KVShape(GQA.n_layers, 1, 2, 16, 16, 8), FloatCodec(16, torch.float16),
                                           FloatCodec(16, torch.float32))), "fp32/fp16/bf16 CPU cache"),
    (lambda model: (Decoder(ModelConfig(vocab_size=96, dim=64, n_layers=1, n_heads=4, bias=True)), None),
     "bias-free Llama-family"),
])
def test_what_cannot_be_fused_says_why(change, reason):
    model, cache = change(ggml_model(GQA))
    assert reason in why_not_fused(model, cache)
    assert fused_step_for(model, cache) is None
    with pytest.raises(ValueError, match="cannot fuse"):
        FusedDecodeStep(model, cache)


def test_the_vector_exp_is_as_close_as_expf():
    """Attention's softmax uses an 8-lane e^x (scores minus their maximum, so x <= 0)."""
    x = torch.cat([-torch.rand(100_003, generator=torch.Generator().manual_seed(0)) * 87, torch.zeros(5)])
    y = torch.empty_like(x)
    kernels().exp_nonpositive(x.data_ptr(), y.data_ptr(), x.numel())
    exact = torch.exp(x.double())
    assert ((y.double() - exact).abs() / exact).max().item() < 2 * torch.finfo(torch.float32).eps  # measured 1.1e-7
    assert torch.equal(y[-5:], torch.ones(5))
