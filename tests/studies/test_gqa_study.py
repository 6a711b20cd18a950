"""`kvlab study gqa --quick` end to end (the pipeline, not the science), resumption, and the presets."""

import json
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.studies import gqa_measure
from kvlab.studies.gqa_config import PRESETS, variants
from kvlab.files import read_json
from needs import SHAKESPEARE, require_file

RUN_KEYS = {"variant", "kv_heads", "seed", "val_loss", "train_tokens_per_s", "history"}
UPTRAIN_KEYS = {"method", "kv_heads", "val_loss_before", "val_loss_after", "steps"}


@pytest.fixture
def shakespeare() -> Path:
    return require_file(SHAKESPEARE, "../shared/data/tinyshakespeare.txt")


def test_presets_differ_only_in_attention_and_mla_matches_mha_params():
    for preset in PRESETS.values():
        found = {v.name: v for v in variants(preset, 65)}
        assert list(found) == ["mha", "gqa-2", "mqa", "mla"]
        assert [found[n].kv_heads for n in ("mha", "gqa-2", "mqa")] == [8, 2, 1]
        mha = found["mha"].config
        for v in found.values():
            c = v.config
            assert (c.dim, c.n_layers, c.n_heads, c.rope_style, c.mlp) == (mha.dim, mha.n_layers, mha.n_heads,
                                                                           mha.rope_style, mha.mlp)
            assert c.max_seq_len > preset.decode_tokens  # decoding runs past the training context
        assert abs(found["mla"].config.param_count() / mha.param_count() - 1) < 0.01
    seed = PRESETS["seed"]
    assert (seed.n_layers, seed.n_heads, seed.dim, seed.block_size) == (6, 8, 256, 256)


def test_quick_study_end_to_end_and_resume_after_a_failure(shakespeare, tmp_path, monkeypatch, capsys):
    work, out = tmp_path / "work", tmp_path / "report"
    args = ["study", "gqa", "--quick", "--data", str(shakespeare), "--work", str(work), "--out", str(out),
            "--no-progress", "--json"]

    def dies(*a, **k):
        raise RuntimeError("killed during decode timing")

    monkeypatch.setattr(gqa_measure, "decode_speed", dies)
    with pytest.raises(RuntimeError):
        main(args)
    partial = read_json(out / "results.json")
    assert partial["complete"] is False and len(partial["runs"]) == 8  # 4 variants x 2 seeds kept
    monkeypatch.undo()

    capsys.readouterr()
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert results == read_json(out / "results.json") and results["complete"] is True
    assert [r["val_loss"] for r in results["runs"]] == [r["val_loss"] for r in partial["runs"]]  # reused

    assert {(r["variant"], r["seed"]) for r in results["runs"]} == {
        (v, s) for v in ("mha", "gqa-2", "mqa", "mla") for s in (0, 1)}
    for run in results["runs"]:  # a seed's record holds its own measurements only, none copied from seed 0
        assert RUN_KEYS <= set(run) and not {"kv_bytes_measured", "decode_tokens_per_s"} & set(run)
    assert set(results["decode"]) == {"mha", "gqa-2", "mqa", "mla"}  # decode measured once per variant
    for cells in results["decode"].values():
        assert set(cells) == {"1", "4"}
        assert all(c["kv_bytes_formula"] == c["kv_bytes_measured"] > 0 for c in cells.values())
    for rows in results["cache_bytes_prefill"].values():
        assert all(r["kv_bytes_formula"] == r["kv_bytes_measured"] for r in rows)
    assert {(u["method"], u["kv_heads"]) for u in results["uptraining"]} == {
        (m, k) for m in ("mean", "first", "random") for k in (2, 1)}
    assert all(UPTRAIN_KEYS <= set(u) and u["steps"] == 2 for u in results["uptraining"])
    prov = results["provenance"]
    assert {"git_commit", "git_dirty_files", "torch_version", "machine", "seeds", "wall_seconds", "data"} <= set(prov)
    assert {"cpu", "cores", "torch_threads"} <= set(prov["machine"])  # kvlab.bench.provenance's one schema
    assert prov["data"]["sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert results["preset"]["n_heads"] == 8 and results["seeds"] == [0, 1]
    readme = (out / "README.md").read_text()
    assert "kvlab study gqa --quick" in readme and "## Findings" in readme
    for name in ("val_loss", "cache_bytes", "decode_speed", "uptraining"):
        assert (out / f"{name}.png").stat().st_size > 1000 and f"({name}.png)" in readme

    (out / "discussion.md").write_text("Written by hand after the run.")
    assert main(["study", "gqa", "--render-only", "--out", str(out)]) == 0
    assert "## Discussion\n\nWritten by hand after the run." in (out / "README.md").read_text()
    assert read_json(out / "results.json") == results  # rendering changes no result

    capsys.readouterr()
    assert main(args[:-1]) == 0  # the README's form, without --json: resumes everything, prints the summary
    printed = capsys.readouterr().out
    assert "GQA study (quick)" in printed and "b4" in printed and "uptraining from MHA" in printed


def test_bad_seeds_are_one_line_errors(capsys):
    assert main(["study", "gqa", "--quick", "--seeds", "0,x"]) == 2
    assert "--seeds" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["study", "gqa", "--steps", "0"])
    assert exit_info.value.code == 2


def test_findings_call_small_differences_seed_noise():
    from kvlab.report.gqa_findings import quality

    def item(kv, low, high):
        return {"kv_heads": kv, "seeds": 2, "val_loss_mean": (low + high) / 2, "val_loss_min": low,
                "val_loss_max": high}

    results = {"summary": {"mha": item(8, 1.50, 1.52), "gqa-2": item(2, 1.505, 1.525), "mqa": item(1, 1.60, 1.61)}}
    lines = "\n".join(quality(results))
    assert "gqa-2 vs mha: +0.0050" in lines and "within seed noise" in lines.split("gqa-2 vs mha")[1].split("\n")[0]
    assert "mqa vs mha: +0.0950" in lines and "worse than MHA" in lines


def test_summary_prints_from_the_committed_results(capsys):
    """The table `kvlab study gqa` prints at the end reads decode speed from the results' "decode" section
    (measured once per variant); it once read a per-seed key that had moved, and every run crashed there."""
    from kvlab.commands.study_cmd import print_summary

    results = read_json(Path(__file__).resolve().parents[2] / "reports" / "gqa-study" / "results.json")
    print_summary(results)
    printed = capsys.readouterr().out
    mha = next(line for line in printed.splitlines() if "mha" in line)
    assert "681" in mha and "2,106" in mha  # reports/gqa-study's medians at batch 1 and 32
