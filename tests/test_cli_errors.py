"""The CLI's parser: a flag is never guessed from its first letters."""

import pytest

from kvlab.cli import main


def test_a_flag_prefix_is_not_taken_for_a_longer_flag(capsys):
    """`--output` once silently meant `--output-len` in `kvlab bench throughput`."""
    with pytest.raises(SystemExit) as raised:
        main(["bench", "throughput", "stories260k", "--output", "result.json"])
    assert raised.value.code == 2
    assert "unrecognized arguments: --output result.json" in capsys.readouterr().err
