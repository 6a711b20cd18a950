"""kvlab.report.markdown.table: the one writer of every report's markdown tables."""

import pytest

from kvlab.report.markdown import table
from kvlab.plan.units import exact_and_binary


def test_table_lines_and_alignment():
    assert table(["variant", "KV heads", "bytes"], [["mha", 8, "4,096"], ["mqa", 1, "512"]], "lrr") == [
        "| variant | KV heads | bytes |", "|---|---:|---:|", "| mha | 8 | 4,096 |", "| mqa | 1 | 512 |"]
    assert table(["a", "b"], [])[1] == "|---|---|"  # unspecified columns are left-aligned
    assert table(["a"], [], "c")[1] == "|:---:|"


def test_table_rejects_ragged_rows_and_unknown_alignments():
    with pytest.raises(ValueError, match="2 cells in a table of 3"):
        table(["a", "b", "c"], [[1, 2]])
    with pytest.raises(ValueError, match="use l, r or c"):
        table(["a"], [], "x")


def test_exact_and_binary_as_the_reports_show_it():
    assert exact_and_binary(512) == "512 B"
    assert exact_and_binary(1_024_512) == "1,024,512 B (1000.50 KiB)"
    assert exact_and_binary(262_275_072) == "262,275,072 B (250.12 MiB)"
    assert exact_and_binary(5 * 2**30) == "5,368,709,120 B (5.00 GiB)"
