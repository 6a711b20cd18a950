"""`kvlab uptrain` on stories260K: the distillation loss, resumable slices, the report's counts."""

import json

import pytest
import torch

from needs import STORIES, require_file
from kvlab.cli import main
from kvlab.train.distill import distill_loss

FLAGS = ["--steps", "4", "--teacher-tokens", "1500", "--block-size", "32", "--batch-size", "2",
         "--checkpoint-every", "1", "--json"]


def test_kl_is_zero_against_itself_and_alpha_zero_is_the_lm_loss():
    logits, targets = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)), torch.randint(0, 11, (2, 5))
    loss, kl, lm = distill_loss(logits, logits.clone(), targets, alpha=1.0, temperature=2.0)
    assert kl == pytest.approx(0.0, abs=1e-6) and float(loss) == pytest.approx(0.0, abs=1e-6)
    loss, _, lm = distill_loss(logits, torch.zeros_like(logits), targets, alpha=0.0, temperature=1.0)
    assert float(loss) == lm == pytest.approx(float(torch.nn.functional.cross_entropy(logits.reshape(-1, 11),
                                                                                      targets.reshape(-1))))


@pytest.fixture
def converted(tmp_path):
    stories = str(require_file(STORIES, "../shared/models/stories260K.gguf"))
    out = tmp_path / "mqa"
    assert main(["convert", stories, "--kv-heads", "1", "-o", str(out), "--json"]) == 0
    return stories, out


def weights(path):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(str(path)).model.state_dict()


def test_sliced_run_equals_one_run_and_reports_steps_and_tokens(converted, tmp_path, capsys):
    stories, out = converted
    import shutil
    shutil.copytree(out, tmp_path / "whole")
    converted_weights = weights(out)
    capsys.readouterr()
    assert main(["uptrain", str(out), "--teacher", stories, *FLAGS, "--stop-after", "2"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["steps"], first["finished"], first["tokens"]) == (2, False, 2 * 2 * 32)
    assert all(torch.equal(a, b) for a, b in zip(weights(out).values(), converted_weights.values()))
    assert main(["uptrain", str(out), "--teacher", stories, *FLAGS]) == 0
    sliced = json.loads(capsys.readouterr().out)
    assert (sliced["steps"], sliced["finished"], sliced["tokens"]) == (4, True, 4 * 2 * 32)
    assert main(["uptrain", str(tmp_path / "whole"), "--teacher", stories, *FLAGS]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["tokens"] == sliced["tokens"]
    a, b = weights(out), weights(tmp_path / "whole")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not all(torch.equal(a[name], converted_weights[name]) for name in a)  # training changed OUT


def test_uptrain_refuses_a_folder_without_a_model(tmp_path, capsys):
    assert main(["uptrain", str(tmp_path), "--teacher", "stories260k"]) == 2


def test_rerunning_a_slice_command_continues_and_the_checkpoint_holds_only_what_trains(converted, capsys):
    """The README's slice: the same `--stop-after` command, run twice, does the next steps the second time."""
    stories, out = converted
    flags = ["uptrain", str(out), "--teacher", stories, *FLAGS, "--stop-after", "2"]
    assert main(flags) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    saved = torch.load(f"{out}.uptrain.pt", weights_only=False)
    assert set(saved["trained"]) and all(".attn." in name or "norm" in name for name in saved["trained"])
    assert "model" not in saved  # the frozen weights stay in OUT
    assert main(flags) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["steps"], report["finished"]) == (4, True)
    record = json.loads((out.parent / f"{out.name}.uptrain.json").read_text())["record"]
    assert [entry["tokens"] for entry in record] == [step * 2 * 32 for step in (1, 2, 3, 4)]
    assert all(entry["val_kl"] >= 0 for entry in record)


def test_a_token_budget_sets_the_steps(converted, capsys):
    stories, out = converted
    flags = [f for f in FLAGS if f != "--json"][2:]  # without --steps 4
    assert main(["uptrain", str(out), "--teacher", stories, *flags, "--tokens", "130", "--train", "all",
                 "--hidden-weight", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["of_steps"], report["tokens"], report["train"]) == (3, 3 * 64, "all")  # ceil(130 / (2 x 32))
    from kvlab.checkpoints.resolve import load_checkpoint
    assert report["trainable_parameters"] == load_checkpoint(str(out)).model.config.param_count()
