"""Q8_0 packing of a dense model (kvlab.nn.pack): GGUF's rounding rule, and a model that still computes the same."""

import pytest
import torch

from kvlab.nn.config import ModelConfig
from kvlab.nn.ggml import GGMLLinear
from kvlab.nn.model import Decoder
from kvlab.nn.pack import pack_q8_0, q8_0_planes

from needs import require_kernels


def test_q8_0_planes_round_each_weight_to_its_group_scale():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[1, :32] = 0  # an all-zero group: scale 0, codes 0
    planes = q8_0_planes(w)
    assert planes.codes.dtype == torch.int8 and planes.scales.shape == (4, 2)
    assert torch.equal(planes.scales[0, 0], w[0, :32].abs().max() / 127)
    assert int(planes.codes.abs().max()) == 127  # each group's largest weight is +-127 codes
    assert (planes.dense() - w).abs().le(planes.scales.repeat_interleave(32, dim=1) / 2 + 1e-7).all()
    assert planes.dense()[1, :32].abs().max() == 0


def test_a_packed_model_keeps_its_logits_and_argmax():
    require_kernels()
    config = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=32,
                         tie_embeddings=True)
    torch.manual_seed(0)
    dense = Decoder(config).eval()
    packed = pack_q8_0(dense)
    assert isinstance(packed.lm_head, GGMLLinear) and packed.packing == "gguf"
    assert dense.lm_head.weight is dense.embed.weight  # the original is untouched
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = dense(tokens), packed(tokens)
    torch.testing.assert_close(b, a, rtol=0, atol=0.02 * float(a.abs().max()))


def test_biased_models_are_refused():
    config = ModelConfig(vocab_size=96, dim=64, n_layers=1, n_heads=2, bias=True, mlp="gelu", norm="layernorm")
    with pytest.raises(ValueError, match="bias-free"):
        pack_q8_0(Decoder(config))
