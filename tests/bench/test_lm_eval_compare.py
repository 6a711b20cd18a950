"""lm-evaluation-harness's tasks built from the novels, and lm-eval run against `kvlab serve` (slow)."""

from __future__ import annotations

import json

import pytest

from kvlab.evals.lm_eval_tasks import CLOZE_TASK, PASSKEY_TASK, write_tasks
from needs import SHARED, require_file, require_module, require_smollm2


@pytest.fixture
def shared():
    require_file(SHARED / "data" / "english" / "frankenstein.txt", "../shared/data/english/frankenstein.txt")
    return SHARED


def test_tasks_are_local_deterministic_and_well_formed(tmp_path, shared):
    counts = write_tasks(tmp_path / "a", shared, cloze=12, passkey=3)
    write_tasks(tmp_path / "b", shared, cloze=12, passkey=3)
    assert counts == {CLOZE_TASK: 12, PASSKEY_TASK: 3}
    for name in counts:
        assert (tmp_path / "a" / f"{name}.jsonl").read_bytes() == (tmp_path / "b" / f"{name}.jsonl").read_bytes()
        yaml = (tmp_path / "a" / f"{name}.yaml").read_text()
        assert "dataset_path: json" in yaml and str((tmp_path / "a" / f"{name}.jsonl").resolve()) in yaml
    for line in (tmp_path / "a" / f"{CLOZE_TASK}.jsonl").read_text().splitlines():
        item = json.loads(line)
        assert len(item["choices"]) == 4 == len(set(w.lower() for w in item["choices"]))
        assert 0 <= item["answer"] < 4 and not item["context"].endswith(" ")
    for line in (tmp_path / "a" / f"{PASSKEY_TASK}.jsonl").read_text().splitlines():
        item = json.loads(line)
        assert item["prompt"].count(item["passkey"]) == 2 and item["prompt"].endswith("The pass key is")


def test_lm_eval_reads_the_tasks_without_a_hub(tmp_path, shared):
    require_module("lm_eval")
    from lm_eval.tasks import TaskManager, get_task_dict

    write_tasks(tmp_path, shared, cloze=4, passkey=2)
    tasks = get_task_dict([CLOZE_TASK, PASSKEY_TASK], TaskManager(include_path=str(tmp_path)))
    cloze = tasks[CLOZE_TASK]
    doc = next(iter(cloze.test_docs()))
    assert cloze.doc_to_choice(doc) == doc["choices"] and cloze.doc_to_target(doc) == doc["answer"]


@pytest.mark.slow
def test_lm_eval_scores_kvlab_serve(tmp_path, shared):
    """lm-eval's local-completions model against `kvlab serve` SmolLM2: log-likelihoods through echo and prompt
    log-probabilities, generations, the server's own tokenizer (the kvlab half of the serving report's table)."""
    require_module("lm_eval")
    require_smollm2()
    from kvlab.bench.lm_eval_compare import run

    result = run("smollm2-135m", ["kvlab"], cloze=8, passkey=4, threads=2, tasks_dir=tmp_path)
    r = result["servers"]["kvlab"]
    assert r["cloze_acc"] >= 0.5 and r["passkey_exact_match"] >= 0.5
    assert len(r["cloze_loglikelihoods"]) == 8 and all(len(x) == 4 and max(x) < 0 for x in r["cloze_loglikelihoods"])
