"""KV-head conversion (Ainslie et al., 2023): identities the ANCHORS require, and the function kept."""

import pytest
import torch

from kvlab.checkpoints.convert import convert_kv_heads, regroup_kv_rows
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

CONFIG = ModelConfig(vocab_size=40, dim=48, n_layers=2, n_heads=6, n_kv_heads=6, max_seq_len=32)


def test_groups_equal_heads_is_identity():
    model = Decoder(CONFIG)
    same = convert_kv_heads(model, 6)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, same.state_dict()[name])


def test_repeat_then_mean_pool_returns_the_original_exactly():
    w = torch.randn(2 * 8, 48)
    for method in ("mean", "first"):
        assert torch.equal(regroup_kv_rows(regroup_kv_rows(w, 8, 6), 8, 2, method), w)


def test_repeating_kv_heads_keeps_the_function():
    torch.manual_seed(0)
    gqa = Decoder(ModelConfig(vocab_size=40, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=32)).eval()
    mha = convert_kv_heads(gqa, 6)
    tokens = torch.randint(0, 40, (1, 9))
    with torch.inference_mode():
        torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-5)
    assert mha.config.kv_heads == 6 and gqa.config.kv_heads == 2


def test_mean_first_and_random_pooling():
    w = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4 * 2, 3)  # 4 heads of dim 2
    heads = w.reshape(4, 2, 3)
    assert torch.equal(regroup_kv_rows(w, 2, 2, "mean").reshape(2, 2, 3), (heads[0::2] + heads[1::2]) / 2)
    assert torch.equal(regroup_kv_rows(w, 2, 2, "first").reshape(2, 2, 3), heads[0::2])
    random = regroup_kv_rows(w, 2, 1, "random", torch.Generator().manual_seed(0))
    assert random.shape == (2, 3) and not torch.equal(random, heads[0])


def test_converted_model_shares_no_storage_and_pools_to_mqa():
    model = Decoder(CONFIG)
    mqa = convert_kv_heads(model, 1)
    assert mqa.config.kv_heads == 1
    assert mqa.blocks[0].attn.qkv.weight.shape == ((6 + 2) * 8, 48)
    mqa.embed.weight.data.zero_()
    assert model.embed.weight.abs().sum() > 0


def test_bad_head_counts_are_plan_errors():
    with pytest.raises(PlanError, match="divide"):
        convert_kv_heads(Decoder(CONFIG), 4)
