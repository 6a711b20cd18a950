"""Every committed report page renders byte for byte from the JSON committed beside it.

report/ only renders (bench/ measures), so a page is a function of its JSON: `kvlab report NAME`
on a copy of the folder must write the page that is committed, or the code and the page have
drifted (a figure re-worded, a table re-joined) without the page being regenerated.
The GQA study's page and figures (`kvlab study gqa --render-only`) are held to the same rule.
"""

import shutil
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.commands.report_cmd import REPORTS

ROOT = Path(__file__).resolve().parents[2]
PAGE = {"vllm-conversions": "conversions.md"}


@pytest.mark.parametrize("report", sorted(REPORTS))
def test_a_committed_report_renders_from_its_json_byte_for_byte(report, tmp_path, capsys):
    default = ROOT / REPORTS[report][0]
    folder = default.parent if default.suffix == ".json" else default
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    page = PAGE.get(report, "README.md")
    (copy / page).unlink()
    target = copy / default.name if default.suffix == ".json" else copy
    assert main(["report", report, str(target)]) == 0
    assert (copy / page).read_bytes() == (folder / page).read_bytes(), f"reports/{folder.name}/{page}"


def test_the_gqa_study_renders_its_page_and_figures_byte_for_byte(tmp_path):
    folder = ROOT / "reports" / "gqa-study"
    copy = tmp_path / "gqa-study"
    shutil.copytree(folder, copy)
    for drawn in ("README.md", *(p.name for p in folder.glob("*.png"))):
        (copy / drawn).unlink()
    assert main(["study", "gqa", "--render-only", "--out", str(copy)]) == 0
    for drawn in ("README.md", *(p.name for p in folder.glob("*.png"))):
        assert (copy / drawn).read_bytes() == (folder / drawn).read_bytes(), drawn


def test_a_report_folder_that_is_not_there_is_one_line(tmp_path, capsys):
    assert main(["report", "serving", str(tmp_path / "none")]) == 2
    assert "no " in capsys.readouterr().err
