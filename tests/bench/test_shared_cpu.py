"""kvlab bench shared-cpu: its commands parse as kvlab's own, and its summary's arithmetic."""

from kvlab.bench.shared_cpu import commands, summarise
from kvlab.cli import build_parser


def test_the_measured_commands_are_kvlab_commands_with_json():
    for argv, key in commands("stories260k", 8).values():
        args = build_parser(argv[3]).parse_args([a.replace("{json}", "out.json") for a in argv[3:]])
        assert args.json and key


def test_the_summary_is_medians_and_the_loaded_share_of_quiet():
    figures = {"measure": {"quiet": {"fixed": [100.0, 120.0, 110.0], "adaptive": [118.0, 100.0, 110.0]},
                           "beside a busy core": {"fixed": [3.0, 2.0, 4.0], "adaptive": [50.0, 60.0, 55.0]}}}
    summary = summarise(figures)["measure"]
    assert summary["median"]["quiet"] == {"fixed": 110.0, "adaptive": 110.0}
    assert summary["loaded_share_of_quiet"] == {"fixed": 3.0 / 110.0, "adaptive": 55.0 / 110.0}


def test_crossover_on_a_model_without_gguf_blocks_says_so(capsys):
    from needs import STORIES, require_file

    from kvlab.cli import main
    require_file(STORIES, "../shared/models/stories260K.gguf")
    assert main(["bench", "crossover", str(STORIES)]) == 0
    assert "no GGUF-block matrices" in capsys.readouterr().out
