"""--weights auto is decided in one place (kvlab.checkpoints.resolve.resolve_packing) for every command."""

import pytest

from kvlab.checkpoints.resolve import resolve_packing
from kvlab.nn.kernels import kernels
from kvlab.plan.errors import PlanError


def test_auto_means_gguf_where_the_kernels_build_and_dense_with_a_head_conversion():
    assert resolve_packing("auto") == ("gguf" if kernels() is not None else "dense")
    assert resolve_packing("auto", kv_heads=1) == "dense"  # averaged heads are no longer 4-bit blocks
    assert resolve_packing("gguf-a8") == "gguf-a8" and resolve_packing("dense", kv_heads=1) == "dense"


def test_a_packing_that_cannot_hold_converted_heads_is_a_one_line_error():
    with pytest.raises(PlanError, match="--kv-heads averages weights"):
        resolve_packing("gguf", kv_heads=1)
    with pytest.raises(PlanError, match="--weights must be one of"):
        resolve_packing("q4")
