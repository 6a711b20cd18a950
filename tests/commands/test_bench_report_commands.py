"""Every measurement is a `kvlab bench` sub-command and every page a `kvlab report` one: each has --help,
and bad input is one line (exit 2) before anything is loaded or measured."""

import pytest

from kvlab.cli import main
from kvlab.commands.report_cmd import REPORTS

BENCHES = ("prefix-ttft", "serving-bound", "vllm-interop", "structured", "lm-eval", "reliability", "startup",
           "speculative", "eagle", "real-models", "kvquant-split", "conversions", "vllm-conversions", "mla-quality",
           "fleet-validate", "fleet-report")


@pytest.mark.parametrize("argv", [["bench", name, "--help"] for name in BENCHES]
                         + [["report", name, "--help"] for name in REPORTS])
def test_each_sub_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0 and "usage: kvlab" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["bench", "structured", "--parts", "nope"], "unknown part 'nope'"),
    (["bench", "lm-eval", "--servers", "foo"], "unknown server 'foo'"),
    (["bench", "eagle", "--head", "/nonexistent"], "no eagle head in /nonexistent"),
    (["bench", "vllm-conversions", "--variants", "gqa"], "unknown variants ['gqa']"),
    (["report", "startup", "/nonexistent"], "no /nonexistent"),
    (["bench", "mla-quality", "--out", "/nonexistent"], "no /nonexistent"),
    (["bench", "fleet-validate", "--calibration", "/nonexistent.json"], "no /nonexistent.json"),
    (["report", "fleet", "/nonexistent"], "no /nonexistent"),
])
def test_bad_input_is_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["bench", "conversions", "--max-seconds", "-1"],
                                  ["bench", "prefix-ttft", "--requests", "0"], ["report", "nope"],
                                  ["bench", "mla-quality", "stories260k", "--grid", "full:x"],
                                  ["bench", "fleet-validate", "--loads", "0.5,-1"]])
def test_bad_flags_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_the_mla_quality_bench_without_a_model_re_renders_its_page(tmp_path, capsys):
    """`kvlab bench mla-quality` with no model is the old script's render-only mode: the page from the JSONs."""
    import shutil
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "reports" / "mla-convert"
    shutil.copytree(folder, tmp_path / "mla")
    (tmp_path / "mla" / "README.md").unlink()
    assert main(["bench", "mla-quality", "--out", str(tmp_path / "mla")]) == 0
    assert (tmp_path / "mla" / "README.md").read_bytes() == (folder / "README.md").read_bytes()


def test_the_fleet_examples_run_through_the_fleet_and_plan_parsers():
    """The fleet report's in-process runs parse their command lines with `kvlab fleet`'s and `kvlab plan`'s own
    parsers: a scenario is built (not run) and the planner's speculative figures come back."""
    from pathlib import Path

    from kvlab.bench.fleet_examples import DATACENTRE, DRAFT
    from kvlab.commands.bench_lab_cmd import fleet_scenario, plan_result

    scenario = fleet_scenario(f"{DATACENTRE} --kv-cache-dtype fp8".split())
    assert hasattr(scenario, "run") and hasattr(scenario, "figures")
    planned = plan_result(["llama-3-70b", "--gpu", "h100", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "8",
                           "--draft", str(Path(__file__).resolve().parents[2] / DRAFT), "--acceptance-rate", "0.7",
                           "--num-speculative-tokens", "4"])
    assert planned["speculative"]["expected_speedup"] > 1
