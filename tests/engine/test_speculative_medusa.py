"""Speculation with a Medusa head set (kvlab.nn.medusa) and, for the distribution test, an EAGLE head:
greedy output equals the output without it, on the C step and module by module, at batch 1 and in a
mixed batch; sampled output follows the target's distribution (chi-square); the pool ends empty;
a head set trained for another target, or with fewer heads than k, is refused in one line."""

import sys
from pathlib import Path

import pytest
import torch

from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.errors import KvlabError
from kvlab.nn.config import ModelConfig
from kvlab.nn.eagle import EagleConfig, EagleHead
from kvlab.nn.draft_head import save_head
from kvlab.nn.medusa import MedusaConfig, MedusaHead
from kvlab.nn.model import Decoder
from engine_helpers import assert_pool_free, run_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import GQA, ggml_model  # noqa: E402

from needs import require_kernels
from spec_head_helpers import PROMPTS, TARGET, greedy_with_and_without, outputs



def medusa_dir(directory: Path, config: ModelConfig = TARGET, heads: int = 3, seed: int = 4) -> str:
    """A random head set (its blocks too: a zero block would guess the target's own next token) over half
    the target's vocabulary, in a shuffled order."""
    torch.manual_seed(seed)
    vocab = config.vocab_size
    head = MedusaHead(MedusaConfig(target=config.name, dim=config.dim, target_vocab=vocab, draft_vocab=vocab // 2,
                                   num_heads=heads), torch.randperm(vocab)[:vocab // 2])
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    save_head(head, str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return medusa_dir(tmp_path_factory.mktemp("head") / "medusa")


@pytest.mark.parametrize("paged_step", [True, False], ids=["c-step", "modules"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_with_medusa_heads_is_the_output_without(head, paged_step, batch):
    spec = {"method": "medusa", "model": head, "num_speculative_tokens": 3}
    engine, got, want = greedy_with_and_without(spec, batch, paged_step)
    assert got == want
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts  # several drafts a round
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    assert any("Medusa heads (3): no KV cache" in line for line in engine.capacity_lines)


def test_sampled_speculation_with_medusa_heads_is_seed_reproducible(head):
    model = Decoder(TARGET).eval()
    spec = {"method": "medusa", "model": head, "num_speculative_tokens": 2}
    runs = [outputs(model, spec, PROMPTS[:2], paged_step=False, temperature=0.9)[1] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(ids) == 20 for ids in runs[0].values())


# -- the distribution test: sampled tokens that went through the acceptance rule follow the target ----------

SMALL = ModelConfig(**{**GQA.to_dict(), "vocab_size": 8, "max_seq_len": 16, "n_layers": 1, "name": "small"})
CHI2_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, alpha = 0.001
TRIALS = 1000


def eagle_dir(directory: Path, config: ModelConfig) -> str:
    torch.manual_seed(7)
    vocab = config.vocab_size
    head = EagleHead(EagleConfig(target=config.name, dim=config.dim, target_vocab=vocab, draft_vocab=6, n_heads=2,
                                 head_dim=16, ffn=32, window=3), torch.randperm(vocab)[:6])
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    save_head(head, str(directory))
    return str(directory)


def exact_marginals(model: Decoder, prompt: list[int], length: int = 3) -> list[torch.Tensor]:
    """The target's distribution of each of the first `length` sampled tokens (temperature 1), by enumeration."""
    vocab = model.config.vocab_size
    paths = {(): 1.0}
    out = []
    with torch.inference_mode():
        for _ in range(length):
            marginal, grown = torch.zeros(vocab, dtype=torch.float64), {}
            for path, weight in paths.items():
                p = torch.softmax(model(torch.tensor([prompt + list(path)]))[0, -1].double(), -1)
                marginal += weight * p
                for t in range(vocab):
                    grown[path + (t,)] = weight * float(p[t])
            out.append(marginal)
            paths = grown
    return out


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_sampled_tokens_through_a_head_follow_the_targets_distribution(tmp_path, method):
    """The second and third tokens of every request went through drafting and the acceptance rule (a head
    scoring 6 of the 8 tokens, so q is zero where p is not: only the residual can emit those)."""
    require_kernels()
    model = ggml_model(SMALL, seed=3)  # the C step: a thousand short requests in seconds
    directory = (medusa_dir(tmp_path / "h", SMALL, heads=2) if method == "medusa" else eagle_dir(tmp_path / "h", SMALL))
    prompt = [1, 2]
    engine = LLMEngine(model, None, EngineConfig(kv_cache_memory=400_000, block_size=4, max_num_seqs=256,
                                                 max_num_batched_tokens=1024, paged_step=True,
                                                 speculative_config={"method": method, "model": directory,
                                                                     "num_speculative_tokens": 2}))
    for i in range(TRIALS):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=i), request_id=f"r{i}")
    got = run_all(engine)
    assert_pool_free(engine)
    stats = engine.spec_stats
    assert stats.num_drafts > TRIALS // 2 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert stats.num_draft_tokens > stats.num_drafts  # rounds of two drafts
    exact = exact_marginals(model, prompt)
    for position in (1, 2):
        counts = torch.bincount(torch.tensor([ids[position] for ids in got.values()]), minlength=8).double()
        assert chi_square(counts, exact[position]) < CHI2_DF7_P001, (position, counts, exact[position])


# -- refusals ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["medusa", "eagle"])
@pytest.mark.parametrize("other", [{"dim": 32}, {"vocab_size": 128}], ids=["hidden-size", "vocabulary"])
def test_a_head_for_another_target_is_refused_in_one_line(tmp_path, method, other):
    config = ModelConfig(**{**TARGET.to_dict(), **other, "name": "other"})
    directory = medusa_dir(tmp_path / "h", config) if method == "medusa" else eagle_dir(tmp_path / "h", config)
    with pytest.raises(KvlabError) as caught:
        LLMEngine(Decoder(TARGET).eval(), None, EngineConfig(kv_cache_memory=2_000_000, block_size=4,
                                                             speculative_config={"method": method, "model": directory}))
    message = str(caught.value)
    assert f"hidden size {config.dim} and vocabulary {config.vocab_size}" in message and "\n" not in message


def test_a_head_of_the_other_kind_and_too_few_heads_are_refused_in_one_line(tmp_path, head):
    eagle = eagle_dir(tmp_path / "e", TARGET)
    for spec, words in [({"method": "medusa", "model": eagle}, "holds a kvlab-eagle-head, not a kvlab-medusa-head"),
                        ({"method": "medusa", "model": head, "num_speculative_tokens": 4}, "has 3 heads"),
                        ({"method": "medusa", "model": str(tmp_path / "none")}, "not a draft head directory")]:
        with pytest.raises(KvlabError) as caught:
            LLMEngine(Decoder(TARGET).eval(), None, EngineConfig(kv_cache_memory=2_000_000, block_size=4,
                                                                 speculative_config=spec))
        assert words in str(caught.value) and "\n" not in str(caught.value)
