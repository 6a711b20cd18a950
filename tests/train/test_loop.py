"""The training loop: schedule, resumable checkpoints that equal an uninterrupted run, atomic writes."""

import pytest
import torch

from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError
from kvlab.train import loop
from kvlab.train.data import load_corpus
from kvlab.train.loop import TrainConfig, Trainer, lr_at


TINY = ModelConfig(vocab_size=20, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, mlp="gelu", norm="layernorm",
                   tie_embeddings=True, max_seq_len=32, name="tiny")
CONFIG = TrainConfig(steps=12, batch_size=4, block_size=16, warmup=3, eval_every=4, eval_batches=2,
                     checkpoint_every=4, seed=5)


def model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(TINY)


def test_warmup_then_cosine_to_min_lr():
    c = TrainConfig(steps=100, batch_size=1, block_size=1, lr=1e-3, min_lr=1e-4, warmup=10)
    assert lr_at(0, c) == pytest.approx(1e-4) and lr_at(9, c) == pytest.approx(1e-3)
    assert lr_at(10, c) == pytest.approx(1e-3) and lr_at(100, c) == pytest.approx(1e-4)
    rates = [lr_at(s, c) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_a_killed_run_resumes_to_the_same_weights(text_file, tmp_path):
    corpus = load_corpus(text_file)
    straight = model()
    Trainer(straight, corpus, CONFIG, tmp_path / "a.pt", progress=False).fit()

    first = model()
    Trainer(first, corpus, CONFIG, tmp_path / "b.pt", progress=False).fit(stop_after=6)  # "killed" after step 6
    resumed_model = model(seed=99)  # a new process: fresh init, overwritten by the checkpoint
    resumed = Trainer(resumed_model, corpus, CONFIG, tmp_path / "b.pt", progress=False)
    assert resumed.state.step == 6
    state = resumed.fit()

    assert state.step == 12
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed_model.state_dict()[name]), name
    saved_a = torch.load(tmp_path / "a.pt", weights_only=False)["state"]["history"]
    assert [h["val_loss"] for h in saved_a] == [h["val_loss"] for h in state.history]


def test_a_finished_run_does_nothing_more(text_file, tmp_path):
    corpus = load_corpus(text_file)
    Trainer(model(), corpus, CONFIG, tmp_path / "c.pt", progress=False).fit()
    again = Trainer(model(), corpus, CONFIG, tmp_path / "c.pt", progress=False)
    assert again.done and again.fit().step == 12


def test_checkpoint_for_another_setup_is_refused(text_file, tmp_path):
    corpus = load_corpus(text_file)
    Trainer(model(), corpus, CONFIG, tmp_path / "d.pt", progress=False).fit(stop_after=4)
    other = TrainConfig(**{**CONFIG.__dict__, "lr": 5e-4})
    with pytest.raises(PlanError, match="different"):
        Trainer(model(), corpus, other, tmp_path / "d.pt", progress=False)


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "e.pt"
    loop.save_atomic({"step": 1}, path)

    def dies(obj, handle):
        handle.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        loop.save_atomic({"step": 2}, path)
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["e.pt"]
