"""`kvlab bench hybrid-step`'s figures: the engine's own fused and hybrid steps, timed over one pool, as ratios."""

import sys
from pathlib import Path

import pytest

from needs import require_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import GQA, ggml_model  # noqa: E402  (a random model of GGML blocks: both steps run it)


def test_decode_and_verification_figures_are_the_steps_own_ratios():
    require_kernels()
    from kvlab.bench.hybrid_step import measure_decode_steps, measure_verification

    model = ggml_model(GQA)
    decode = measure_decode_steps(model, None, [1, 3], context=32, repetitions=1, iterations=1)
    assert list(decode["rows"]) == ["1", "3"]
    one, three = decode["rows"]["1"], decode["rows"]["3"]
    assert one["hybrid_ms"] is None and one["fused_ms"] > 0  # one row: always the fused step
    assert three["hybrid_over_fused"] == three["hybrid_ms"] / three["fused_ms"]
    verify = measure_verification(model, None, context=32, repetitions=1, iterations=1)
    assert verify["fused"]["verifier"] == "fused" and verify["hybrid"]["verifier"] == "hybrid"
    plain = verify["fused"]["plain_step_ms"]
    assert verify["hybrid"]["over_fused_plain"]["4"] == verify["hybrid"]["step_ms"]["verify:4"] / plain


def test_a_context_off_the_blocks_is_refused():
    require_kernels()
    from kvlab.bench.hybrid_step import measure_decode_steps

    with pytest.raises(ValueError, match="multiple of the pool's 16-token blocks"):
        measure_decode_steps(ggml_model(GQA), None, [2], context=20)


@pytest.mark.parametrize("flag,value", [("--rows", "16,x"), ("--rows", "0"), ("--context", "100")])
def test_bad_flags_are_one_line(flag, value, capsys):
    from kvlab.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["bench", "hybrid-step", flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and flag in err
