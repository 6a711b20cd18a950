"""Every measurement is a `kvlab bench` sub-command and every page a `kvlab report` one: each has --help,
and bad input is one line (exit 2) before anything is loaded or measured."""

import pytest

from kvlab.cli import main
from kvlab.commands.report_cmd import REPORTS

BENCHES = ("prefix-ttft", "serving-bound", "vllm-interop", "structured", "lm-eval", "reliability", "startup",
           "speculative", "eagle", "real-models", "kvquant-split", "conversions", "vllm-conversions")


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
])
def test_bad_input_is_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["bench", "conversions", "--max-seconds", "-1"],
                                  ["bench", "prefix-ttft", "--requests", "0"], ["report", "nope"]])
def test_bad_flags_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and capsys.readouterr().err.count("\n") == 1
