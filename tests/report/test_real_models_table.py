"""The real-models table's rows: each row's own figures, its own throughput cell, nothing borrowed from another."""

import json

from kvlab.bench import real_models_throughput as throughput
from kvlab.report.markdown import row_line
from kvlab.report.real_models import CARDS, DEPTHS, table_cells


def table_line(row, base, measured):
    return row_line(table_cells(row, base, measured))


def _row(label, ppl, line, windows=None):
    return {"label": label, "perplexity": ppl, "perplexity_per_window": windows, "passkey_by_depth": {f"{d:.1f}": [3, 4] for d in DEPTHS},
            "serving": {"kv_bytes_per_sequence_8k": 2**20, **{name: 7 for name in CARDS}},
            "engine_capacity_line": line}


def test_each_row_shows_its_own_throughput_and_ratio(tmp_path):
    (tmp_path / throughput.FILE).write_text(json.dumps({"workload": throughput.workload(), "rows": {
        "fp16": {"output_tokens_per_s": 114.0, "decode_path": "fused C step"},
        "int4": {"output_tokens_per_s": 23.4, "decode_path": "module by module"}}}))
    measured = throughput.load(tmp_path)["rows"]
    base = _row("fp16", 30.0, "Maximum concurrency for 8,192 tokens per request: 1.42x", [20.0, 40.0])
    fp16 = table_line(base, base, measured)
    int4 = table_line(_row("int4", 33.0, None, [21.0, 46.0]), base, measured)
    kivi = table_line(_row("kivi2", None, None), base, measured)
    assert fp16 == "| fp16 | 1.0 | 30.000 | +0.00% | +0.00% / +0.00% | 3/4 | 3/4 | 3/4 | 7 | 7 | 7 | 1.42x | 114.0 |"
    # the change over both windows, then each window's against the same window under fp16
    assert int4.endswith("| +10.00% | +5.00% / +15.00% | 3/4 | 3/4 | 3/4 | 7 | 7 | 7 | – | 23.4 (module by module) |")
    assert kivi.endswith("| – | – |") and "| – | – | – | 3/4" in kivi  # no perplexity, no engine line, no throughput
