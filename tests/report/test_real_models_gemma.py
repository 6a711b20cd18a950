"""The real-models report's Gemma 3 rows: passkey hits by depth and by length from the cells, seats from the plan."""

from kvlab.bench.real_models_study import CARDS, serving, summarise
from kvlab.evals.setting import KVSetting
from kvlab.report import real_models_gemma as gemma
from kvlab.report.markdown import row_line


def _cell(label, length, depth, seed, correct):
    return {"label": label, "task": "passkey", "length": length, "depth": depth, "seed": seed, "trials": 2,
            "correct": correct}


def test_rows_count_each_length_and_depth_and_bound_the_window():
    cells = [_cell("fp16", 4096, 0.1, 0, 2), _cell("fp16", 4096, 0.5, 1, 1), _cell("fp16", 512, 0.1, 0, 0),
             _cell("fp16 sink4+win512", 4096, 0.1, 0, 0),
             {"label": "fp16", "task": "perplexity", "perplexity": 30.0, "per_window_perplexity": [20.0, 40.0],
              "windows": 2, "context": 2048},
             {"label": "fp16", "task": "perplexity", "perplexity": 99.0, "per_window_perplexity": [99.0],
              "windows": 1, "context": 2048}]  # an older, one-window cell: not this report's
    store = {"cells": {str(i): c for i, c in enumerate(cells)}}
    full, window = gemma.STUDY.settings[0], KVSetting("fp16", window=gemma.WINDOW, sinks=gemma.SINKS)
    row = {**summarise(store, full, gemma.STUDY), "serving": serving(full, gemma.STUDY)}
    assert row["passkey_by_length"] == {"512": [0, 2], "2048": [0, 0], "4096": [3, 4]}
    assert row["passkey_by_depth"] == {"0.1": [2, 4], "0.5": [1, 2], "0.9": [0, 0]}
    # at 8k tokens the 3 global layers hold every token, the 15 sliding ones their 512 (1 KV head x 256 x K and V)
    assert row["serving"]["kv_bytes_per_sequence_8k"] == (3 * 8192 + 15 * 512) * 2 * 256 * 2
    row["engine_capacity_line"] = "Maximum concurrency for 8,192 tokens per request: 9.50x"
    runs = {"fp16": {"output_tokens_per_s": 150.04, "decode_path": "fused C step"},
            "kivi4": {"refused": "kivi4 pools serve full-attention K/V layers only"}}
    line = row_line(gemma.table_cells(row, row, runs))
    assert line == "| fp16 | 31.5 | 30.000 | +0.00% | +0.00% / +0.00% | 2/4 | 1/2 | – | 0/2 | – | 3/4 | " + " | ".join(
        str(row["serving"][name]) for name in CARDS) + " | 9.50x | 150.0 |"
    refused = row_line(gemma.table_cells({**row, "label": "kivi4", "engine_capacity_line": None}, row, runs))
    assert refused.endswith("| – | not served: kivi4 pools serve full-attention K/V layers only |")
    bounded = serving(window, gemma.STUDY)
    assert bounded["kv_bytes_per_sequence_8k"] == (3 * 516 + 15 * 512) * 2 * 256 * 2
    assert bounded["L4"] > row["serving"]["L4"]
    section = gemma.section([row, {**summarise(store, window, gemma.STUDY), "serving": bounded}], runs)
    assert section[0] == "## Gemma 3 270M" and section[-1].startswith("| fp16 sink4+win512 | 9.0 | – | – | – | 0/2 |")
