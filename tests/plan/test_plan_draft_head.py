"""`kvlab plan --draft HEAD` and `kvlab fleet --draft HEAD` with a built-in draft head (EAGLE or Medusa):
its weights counted at the target's precision, no K/V (the pool is the target's), its hidden states per
sequence reported, the acceptance rate from its recorded held-out agreement unless given, and the paper's
speed-up with the head's passes priced by the bytes they read. Heads are config.json files only: the
planner reads them with the standard library."""

import json
import math
import sys
from pathlib import Path

import pytest

from kvlab.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
from fleet_helpers import calibration_file  # noqa: E402

D, V, DRAFT_VOCAB = 576, 49152, 8192  # SmolLM2-135M's hidden size and vocabulary
EAGLE_PARAMS = 7_743_168
MEDUSA_BLOCK = D * D + D


def head_dir(tmp_path, kind: str, agreement=0.3116, dim=D, **extra) -> str:
    directory = tmp_path / f"smollm2-{kind}"
    directory.mkdir()
    meta = {"architecture": f"kvlab-{kind}-head", "target": "smollm2-135m", "dim": dim, "target_vocab": V,
            "draft_vocab": DRAFT_VOCAB}
    if kind == "eagle":
        meta |= {"window": 4, "param_count": EAGLE_PARAMS}
    else:
        meta |= {"num_heads": 3, "num_layers": 1, "param_count": 3 * MEDUSA_BLOCK + D * DRAFT_VOCAB}
    train = {"validation": {"chat": {"agree1": agreement}}} if agreement is not None else {}
    (directory / "config.json").write_text(json.dumps({**meta, **extra, "kvlab_train": train}))
    (directory / "model.safetensors").write_bytes(b"")  # the planner never opens it
    return str(directory)


def run_json(capsys, *argv) -> dict:
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


PLAN = ["plan", "smollm2-135m", "--kv-cache-memory", "1GiB", "--context", "1024"]


@pytest.mark.parametrize("kind,k", [("eagle", 2), ("medusa", 2), ("medusa", 3)])
def test_a_head_adds_its_weights_no_kv_and_the_papers_speedup_with_its_passes(tmp_path, capsys, kind, k):
    plain = run_json(capsys, *PLAN)
    got = run_json(capsys, *PLAN, "--draft", head_dir(tmp_path, kind), "--num-speculative-tokens", str(k),
                   "--verify-cost", "1.16")
    target_weights, params = plain["weight_bytes"], plain["model"]["params_total"]
    head_params = EAGLE_PARAMS if kind == "eagle" else 3 * MEDUSA_BLOCK + D * DRAFT_VOCAB
    pass_params = EAGLE_PARAMS if kind == "eagle" else k * MEDUSA_BLOCK + D * DRAFT_VOCAB
    spec = got["speculative"]
    assert spec["draft_weight_bytes"] == math.ceil(head_params * target_weights / params)
    assert got["weight_bytes"] == target_weights + spec["draft_weight_bytes"]
    # no K/V: the pool, tokens and seats are the target's alone
    assert got["kv_bytes_per_token"] == plain["kv_bytes_per_token"] and got["seats"] == plain["seats"]
    assert spec["draft_kv_bytes_per_token"] == 0
    assert spec["pool_blocks"] == 2**30 // (16 * plain["kv_bytes_per_token"])
    assert spec["draft_state_bytes_per_sequence"] == (4 if kind == "eagle" else 1) * D * 4
    passes = k if kind == "eagle" else 1
    assert spec["draft_passes"] == passes
    assert spec["cost_ratio"] == math.ceil(pass_params * target_weights / params) / target_weights
    a = 0.3116
    assert spec["acceptance_rate"] == a and "held-out greedy agreement" in spec["acceptance_source"]
    tokens = (1 - a ** (k + 1)) / (1 - a)
    assert spec["expected_tokens_per_step"] == pytest.approx(tokens, rel=1e-12)
    assert spec["expected_speedup"] == pytest.approx(tokens / (passes * spec["cost_ratio"] + 1.16), rel=1e-12)


def test_a_given_acceptance_rate_wins_over_the_recorded_one_and_the_table_says_which(tmp_path, capsys):
    head = head_dir(tmp_path, "medusa")
    spec = run_json(capsys, *PLAN, "--draft", head, "--acceptance-rate", "0.5")["speculative"]
    assert (spec["acceptance_rate"], spec["acceptance_source"]) == (0.5, "--acceptance-rate")
    assert main(PLAN + ["--draft", head]) == 0
    table = capsys.readouterr().out
    assert "0.3116 from the head's held-out greedy agreement" in table and "no KV" in table


def test_a_head_without_a_recorded_agreement_plans_memory_only(tmp_path, capsys):
    spec = run_json(capsys, *PLAN, "--draft", head_dir(tmp_path, "eagle", agreement=None))["speculative"]
    assert "expected_speedup" not in spec and spec["draft_weight_bytes"] > 0


@pytest.mark.parametrize("kind,flags,message", [
    ("eagle", {"dim": 64}, "trained for a target with hidden size 64 and vocabulary 49152; smollm2-135m has 576"),
    ("medusa", {}, "--num-speculative-tokens 4: the Medusa head set smollm2-medusa has 3 heads"),
])
def test_a_head_for_another_target_or_too_many_tokens_is_one_line(tmp_path, capsys, kind, flags, message):
    head = head_dir(tmp_path, kind, **flags)
    assert main(PLAN + ["--draft", head, "--num-speculative-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_fleet_with_a_head_keeps_the_targets_pool_and_prices_its_rounds(tmp_path, capsys, kind):
    common = ["smollm2-135m", "--kv-cache-memory", "1GiB"]
    cal = calibration_file(tmp_path)
    head = head_dir(tmp_path, kind)
    fleet = ["fleet", "smollm2-135m", "--calibration", cal, "--rate", "2", "--num-requests", "5",
             "--prompt-len", "64", "--output-len", "8", "--draft", head]
    data = run_json(capsys, *fleet)
    assert data["replica"]["num_blocks"] == 1001  # no K/V: the calibrated pool, uncut
    planned = run_json(capsys, "plan", *common, "--draft", head)["speculative"]
    cost = data["replica"]["speculative"]["draft_cost"]
    per_round = planned["cost_ratio"] * planned["draft_passes"] / planned["num_speculative_tokens"]
    assert cost["kind"] == "scaled" and cost["ratio"] == pytest.approx(per_round, rel=1e-12)
    assert data["replica"]["speculative"]["acceptance_rate"] == 0.3116


def test_a_draft_without_a_memory_budget_is_said_not_dropped(tmp_path, capsys):
    head = head_dir(tmp_path, "medusa")
    assert main(["plan", "smollm2-135m", "--draft", head]) == 0
    assert "--draft is planned within a memory budget" in capsys.readouterr().err
