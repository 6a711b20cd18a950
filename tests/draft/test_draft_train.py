"""`kvlab draft train`'s mechanics on tiny sizes: the distillation loss, resuming equals not stopping,
and a saved draft that `speculative_config` loads, with greedy output unchanged."""

import json

import pytest
import torch

from kvlab.cli import main
from kvlab.draft.distill import DistillBatch, DistillTrainer, divergences
from kvlab.draft.model import draft_config, embeddings_from_target
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.train.loop import TrainConfig

from needs import STORIES, require_file

TEACHER = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, name="t")


def records(n: int = 6, seed: int = 0) -> list[dict]:
    """Synthetic corpus records: prompts, answers and a peaked top-5 teacher distribution per answer token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 96, (3 + i % 3,), generator=g, dtype=torch.int32)
        answer = torch.randint(0, 96, (5,), generator=g, dtype=torch.int32)
        top = torch.stack([torch.randperm(96, generator=g)[:5] for _ in range(5)]).to(torch.int32)
        top[:, 0] = answer
        logp = torch.log(torch.tensor([0.6, 0.2, 0.1, 0.05, 0.03])).repeat(5, 1)
        out.append({"workload": "chat", "temperature": 0.0, "prompt_ids": prompt, "output_ids": answer,
                    "top_ids": top, "top_logprobs": logp})
    return out


def test_batch_positions_are_the_answer_tokens_predictors():
    recs = records(2)
    batch = DistillBatch(recs, block_size=64)
    first = len(recs[0]["prompt_ids"]) - 1  # the prompt's last token predicts answer token 0
    assert batch.cols[:5].tolist() == list(range(first, first + 5)) and batch.rows[:5].tolist() == [0] * 5
    assert batch.x[0, first + 1:first + 5].tolist() == recs[0]["output_ids"][:4].tolist()
    cropped = DistillBatch(recs[:1], block_size=4)  # keeps the end: all answer tokens that fit
    assert cropped.x.shape[1] == 4 and cropped.num_targets == 4


def test_divergences_are_zero_at_the_teacher_and_tv_is_one_minus_acceptance():
    batch = DistillBatch(records(1), block_size=64)
    logq = torch.full((batch.num_targets, 96), -1e4)
    p = batch.top_logprobs.exp()
    rest = (1 - p.sum(-1))[0] / 91
    logq[:] = torch.log(rest)
    logq.scatter_(1, batch.top_ids, batch.top_logprobs)  # the teacher itself, remainder spread evenly
    d = divergences(logq, batch)
    assert torch.allclose(d["kl"], torch.zeros_like(d["kl"]), atol=1e-5)
    assert torch.allclose(d["tv"], torch.zeros_like(d["tv"]), atol=1e-5)
    assert d["agree"].min() == 1
    uniform = torch.full((batch.num_targets, 96), -torch.log(torch.tensor(96.0)))
    tv = divergences(uniform, batch)["tv"]
    q = 1 / 96
    want = 1 - (torch.minimum(p, torch.tensor(q)).sum(-1) + torch.minimum(1 - p.sum(-1), torch.tensor(91 * q)))
    assert torch.allclose(tv, want, atol=1e-6)  # 1 - TV = sum of min(p, q) over top-K and the rest


def test_draft_shape_and_embeddings_from_the_teacher():
    config = draft_config(TEACHER, "tiny")
    assert (config.vocab_size, config.kv_heads, config.tie_embeddings, config.rope_base) == (96, 1, True, 10000.0)
    table = torch.randn(96, 64)
    full = embeddings_from_target(table, 64)  # all directions kept: the same Gram matrix (a rotation)
    assert torch.allclose(full @ full.T, table @ table.T, atol=1e-3)


def train(steps: int, checkpoint, stop_after=None):
    torch.manual_seed(0)
    model = Decoder(draft_config(TEACHER, "tiny"))
    config = TrainConfig(steps=steps, batch_size=2, block_size=16, lr=1e-2, warmup=1, eval_every=2, eval_batches=1,
                         checkpoint_every=2)
    recs = records()
    trainer = DistillTrainer(model, recs[:5], recs[5:], config, "kl", checkpoint, progress=False)
    trainer.fit(stop_after=stop_after)
    return model, trainer


@pytest.mark.parametrize("objective", ["kl", "tv"])
def test_a_few_steps_lower_the_objective(objective):
    torch.manual_seed(0)
    model = Decoder(draft_config(TEACHER, "tiny"))
    recs = records()
    config = TrainConfig(steps=12, batch_size=5, block_size=16, lr=3e-2, warmup=1, eval_every=12, eval_batches=1)
    trainer = DistillTrainer(model, recs, recs, config, objective, None, progress=False)
    before = trainer.validation_metrics()[objective]
    trainer.fit()
    assert trainer.validation_metrics()[objective] < before


def test_resuming_equals_training_without_stopping(tmp_path):
    whole, _ = train(4, tmp_path / "a.pt")
    train(4, tmp_path / "b.pt", stop_after=2)
    resumed, trainer = train(4, tmp_path / "b.pt")
    assert trainer.state.step == 4
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_trained_draft_loads_through_speculative_config_and_keeps_greedy_output(tmp_path, capsys):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    out = tmp_path / "draft"
    argv = ["draft", "train", "--teacher", "stories260k", "--size", "tiny", "--steps", "3", "--batch-size", "2",
            "--block-size", "32", "--eval-every", "3", "--corpus-shards", "1", "--shard-size", "4",
            "--max-tokens", "8", "--corpus-dir", str(tmp_path / "corpus"), "--out", str(out), "--no-progress",
            "--json", str(tmp_path / "summary.json")]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "done" and summary["step"] == 3 and summary["tokens"] > 0
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert main(argv) == 0  # a second run finds the corpus and the finished checkpoint: nothing to redo
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 3

    from kvlab.engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["Once upon a time", "The cat sat on the mat and"]
    plain = LLM("stories260k", kv_cache_memory=400_000, block_size=4)
    spec = LLM("stories260k", kv_cache_memory=400_000, block_size=4,
               speculative_config={"method": "draft_model", "model": str(out), "num_speculative_tokens": 3})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    assert spec.engine.blocks.num_free == spec.engine.blocks.num_blocks


def test_an_eagle_head_trains_resumes_and_serves_with_greedy_output_unchanged(tmp_path):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    out = tmp_path / "head"
    argv = ["draft", "train", "--method", "eagle", "--teacher", "stories260k", "--steps", "4", "--batch-size", "2",
            "--eval-every", "2", "--corpus-shards", "1", "--shard-size", "2", "--max-tokens", "8",
            "--draft-vocab", "64", "--corpus-dir", str(tmp_path / "corpus"), "--out", str(out), "--no-progress",
            "--json", str(tmp_path / "summary.json"), "--stop-after", "2"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "partial" and summary["step"] == 2 and summary["positions"] > 0
    assert main(argv[:-2]) == 0  # resumes from OUT.train/checkpoint.pt and the cached hidden states
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "done" and summary["step"] == 4
    assert [h["step"] for h in summary["history"]] == [2, 4]
    assert 0 <= summary["validation"]["chat"]["agree1"] <= 1
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "kvlab-eagle-head" and config["draft_vocab"] == 64

    from kvlab.engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["Once upon a time", "The cat sat on the mat and"]
    plain = LLM("stories260k", kv_cache_memory=400_000, block_size=4)
    spec = LLM("stories260k", kv_cache_memory=400_000, block_size=4,
               speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert spec.engine.spec_stats.num_drafts > 0
    assert spec.engine.blocks.num_free == spec.engine.blocks.num_blocks
