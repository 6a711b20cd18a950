"""Speculation with an EAGLE head (kvlab.nn.eagle): greedy output equals the output without it, on the
C step and module by module, at batch 1 and in a mixed batch; sampled runs are seed-reproducible;
the pool ends empty; a head trained for another target is refused in one line."""


import pytest
import torch

from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.engine.eagle_proposer import record_features
from kvlab.engine.sequence import Sequence
from kvlab.errors import KvlabError
from kvlab.nn.eagle import EagleConfig, EagleHead, save_head
from kvlab.nn.model import Decoder

from needs import require_kernels
from spec_head_helpers import PROMPTS, TARGET, greedy_with_and_without, outputs



def head_dir(tmp_path_factory, dim=TARGET.dim, vocab=TARGET.vocab_size) -> str:
    torch.manual_seed(4)
    config = EagleConfig(target="target", dim=dim, target_vocab=vocab, draft_vocab=vocab // 2, n_heads=2,
                         head_dim=16, ffn=48, window=3)
    directory = tmp_path_factory.mktemp("head") / "eagle"
    save_head(EagleHead(config, torch.randperm(vocab)[:vocab // 2]), str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return head_dir(tmp_path_factory)


@pytest.mark.parametrize("paged_step", [True, False], ids=["c-step", "modules"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_with_a_head_is_the_output_without(head, paged_step, batch):
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    engine, got, want = greedy_with_and_without(spec, batch, paged_step)
    assert got == want
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    assert any("EAGLE head: no KV cache" in line for line in engine.capacity_lines)


def context_free_target() -> Decoder:
    """A target whose blocks add nothing (attention out and MLP down are zero): its hidden state at i is
    norm(embedding(x_i)), so its next token depends on the current one alone."""
    torch.manual_seed(5)
    model = Decoder(TARGET).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o.weight.zero_()
            block.mlp.down.weight.zero_()
    return model


def oracle_head(target: Decoder, directory: str) -> str:
    """The head that is exactly right for `context_free_target`: its feature is norm(embedding(x_{i+1})) (the
    fused input's embedding half passed through, the layer's additions zero), scored by the tied embedding's
    rows for its draft vocabulary (every token, in a shuffled order: the map is exercised)."""
    vocab, dim = TARGET.vocab_size, TARGET.dim
    config = EagleConfig(target="target", dim=dim, target_vocab=vocab, draft_vocab=vocab, n_heads=2, head_dim=16,
                         ffn=48, window=3, norm_eps=TARGET.norm_eps)
    d2t = torch.randperm(vocab, generator=torch.Generator().manual_seed(6))
    head = EagleHead(config, d2t)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, :dim] = torch.eye(dim)
        head.out_norm.weight.copy_(target.norm.weight)
        head.lm_head.weight.copy_(target.embed.weight[d2t])
    save_head(head, directory)
    return directory


@pytest.mark.parametrize("paged_step", [True, False], ids=["c-step", "modules"])
def test_a_head_that_is_right_has_its_drafts_accepted(tmp_path, paged_step):
    """Acceptance, rollback of the bonus and the window's bookkeeping over long accepted runs."""
    if paged_step:
        require_kernels()
    from kvlab.nn.pack import pack_q8_0
    dense = context_free_target()
    model = pack_q8_0(dense) if paged_step else dense
    spec = {"method": "eagle", "model": oracle_head(dense, str(tmp_path / "oracle")), "num_speculative_tokens": 3}
    _, want = outputs(model, None, paged_step=paged_step, max_tokens=30)
    engine, got = outputs(model, spec, paged_step=paged_step, max_tokens=30)
    assert got == want
    stats = engine.spec_stats
    assert stats.acceptance_rate >= 0.9, stats
    assert stats.accepted_per_position[2] > 0


def test_sampled_speculation_with_a_head_is_seed_reproducible(head):
    model = Decoder(TARGET).eval()
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 2}
    runs = [outputs(model, spec, PROMPTS[:2], paged_step=False, temperature=0.9)[1] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(ids) == 20 for ids in runs[0].values())


def test_a_head_for_another_target_is_refused_in_one_line(tmp_path_factory):
    other = head_dir(tmp_path_factory, dim=32)
    with pytest.raises(KvlabError) as caught:
        LLMEngine(Decoder(TARGET).eval(), None, EngineConfig(kv_cache_memory=2_000_000, block_size=4,
                                                             speculative_config={"method": "eagle", "model": other}))
    assert "hidden size 32" in str(caught.value) and "\n" not in str(caught.value)


def test_recorded_features_keep_the_window_and_roll_back():
    seq = Sequence("r", [1, 2, 3], SamplingParams(), 0.0)
    rows = torch.arange(10, dtype=torch.float32)[:, None]
    record_features(seq, 0, rows[:5], window=3)
    assert seq.draft_features[0] == 2 and seq.draft_features[1][:, 0].tolist() == [2, 3, 4]
    record_features(seq, 5, rows[5:7], window=3)  # the next positions extend it
    assert seq.draft_features[0] == 4 and seq.draft_features[1][:, 0].tolist() == [4, 5, 6]
    record_features(seq, 6, rows[8:9], window=3)  # a rerun from position 6 replaces what was there
    assert seq.draft_features[0] == 4 and seq.draft_features[1][:, 0].tolist() == [4, 5, 8]
    record_features(seq, 0, rows[:2], window=3)  # recomputed from the start (a preemption)
    assert seq.draft_features[0] == 0 and seq.draft_features[1][:, 0].tolist() == [0, 1]


def test_disable_by_batch_size_drafts_only_in_smaller_batches(head):
    model = Decoder(TARGET).eval()
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 2, "disable_by_batch_size": 2}
    _, want = outputs(model, None, PROMPTS, paged_step=False)
    engine, got = outputs(model, spec, PROMPTS, paged_step=False)
    assert got == want
    alone, _ = outputs(model, spec, PROMPTS[:1], paged_step=False)
    together = engine.spec_stats.num_drafts
    assert alone.spec_stats.num_drafts > 0
    # four requests of 20 tokens: drafts only once the batch has shrunk below two sequences
    assert together <= alone.spec_stats.num_drafts + 20
    busy, _ = outputs(model, {**spec, "disable_by_batch_size": 1}, PROMPTS[:1], paged_step=False)
    assert busy.spec_stats.num_drafts == 0


def full_pass_drafts(head, model, seq, k):
    """The drafts of the head's full pass over the window, recomputed from scratch each round: the reference."""
    from kvlab.nn.c_model import embed_rows
    first, rows = seq.draft_features
    last = seq.num_tokens - 2
    hidden = rows[:last - first + 1][-head.config.window:]
    begin = last + 1 - len(hidden)
    embedded = embed_rows(model, torch.tensor(seq.all_ids[begin + 1:last + 2]))
    drafts = []
    for _ in range(k):
        features, logits = head(embedded[None], hidden[None])
        drafts.append(int(head.d2t[logits[0, -1].argmax()]))
        embedded = torch.cat((embedded, embed_rows(model, torch.tensor(drafts[-1:]))))[-head.config.window:]
        hidden = torch.cat((hidden, features[0, -1:]))[-head.config.window:]
    return drafts


@torch.inference_mode()
def test_a_round_computes_only_new_positions_and_drafts_as_the_full_pass():
    """The proposer keeps each position's inputs (EagleHead.inputs) between rounds and computes only positions
    recorded since; its drafts are the full pass's, also after a recompute changes a kept hidden state."""
    from kvlab.engine.eagle_proposer import EagleProposer
    torch.manual_seed(1)
    model = Decoder(TARGET).eval()
    config = EagleConfig(target="target", dim=TARGET.dim, target_vocab=TARGET.vocab_size,
                         draft_vocab=TARGET.vocab_size // 2, n_heads=2, head_dim=16, ffn=48, window=3)
    head = EagleHead(config, torch.randperm(TARGET.vocab_size)[:TARGET.vocab_size // 2]).eval()
    proposer = EagleProposer(head, model)
    proposer.head = head  # unpacked: the reference runs the same arithmetic
    computed = []
    inputs = head.inputs
    head.inputs = lambda e, h: computed.append(e.shape[1]) or inputs(e, h)
    seq = Sequence("r", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=0.0, max_tokens=20), 0.0)
    record_features(seq, 0, torch.randn(7, TARGET.dim), window=3)  # positions 0..6: the prompt's but its last
    generator = torch.Generator().manual_seed(0)

    def drafts():
        computed.clear()
        got, _ = proposer.propose([seq], [3], generator)
        rows = list(computed)
        assert got[0] == full_pass_drafts(head, model, seq, 3)
        return rows

    assert drafts() == [3, 1, 1]  # the window's three positions, then one per later round
    seq.output_ids += [7, 8]  # two tokens accepted: positions 7 and 8 recorded
    record_features(seq, 7, torch.randn(2, TARGET.dim), window=3)
    assert drafts() == [2, 1, 1]  # position 6 kept, 7 and 8 new
    seq.draft_features[1][0] += 1  # a recompute changed position 6's hidden state: nothing kept from there on
    assert drafts() == [3, 1, 1]
