"""The CLI's parser: a flag is never guessed from its first letters."""

import pytest

from kvlab.cli import main


def test_a_flag_prefix_is_not_taken_for_a_longer_flag(capsys):
    """`--output` once silently meant `--output-len` in `kvlab bench throughput`."""
    with pytest.raises(SystemExit) as raised:
        main(["bench", "throughput", "stories260k", "--output", "result.json"])
    assert raised.value.code == 2
    assert "unrecognized arguments: --output result.json" in capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    ([], "no KVQuant calibration at"),
    (["--kv-window", "64", "--sink-tokens", "4"], "kvquant4 keeps its own first tokens in fp16"),
])
def test_serve_refuses_a_kvquant_pool_it_cannot_build_in_one_line(capsys, extra, message):
    """`kvlab serve` with kvquant4 and no calibration beside the model (or a window) says why in one line, exit 2,
    before any server starts."""
    from needs import STORIES, require_file

    require_file(STORIES, "../shared/models/stories260K.gguf")
    assert main(["serve", str(STORIES), "--kv-cache-dtype", "kvquant4", "--threads", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
