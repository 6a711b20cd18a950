"""Argument types shared by sub-commands: numbers that must be positive, sizes with units."""

from __future__ import annotations

import argparse

from kvlab.checkpoints.resolve import WEIGHTS_CHOICES
from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import ACTIVATION_DTYPES
from kvlab.plan.units import parse_bytes

WEIGHTS_MEANING = {  # what each --weights choice computes on; a command's help lists only the ones it takes
    "gguf": "compute on a GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K blocks (int16 activations; with an "
            "fp32/fp16/bf16/fp8/int8/int4/int2 cache each decode step is one C call)",
    "gguf-a8": "the same with int8 activations on the 4-bit blocks, as llama.cpp (faster products, +0.4%% "
               "perplexity on SmolLM2, near-tied tokens flip)",
    "dense": "dequantise to fp32, transformers' arithmetic",
    "int4": "PyTorch's int4 kernel (bf16 activations)",
    "q8_0": "round every matrix (a converted directory's safetensors included) to Q8_0 blocks at load and compute "
            "on them as gguf: a directory and its GGUF source then share one arithmetic and the C step",
    "auto": "gguf where its C kernels build, else dense, and dense with --kv-heads",
}


def weights_help(weights: tuple[str, ...]) -> str:
    """The --weights help for a command that takes `weights`: each choice's meaning, in the table's order."""
    return "; ".join(f"{name}: {WEIGHTS_MEANING[name]}" for name in WEIGHTS_MEANING if name in weights)


def add_model_flags(parser, weights: tuple[str, ...] = WEIGHTS_CHOICES, weights_default: str = "auto",
                    dtype: bool = True) -> None:
    """--weights, --dtype and --threads: one definition for every command that loads a model.

    `parser`: a parser or an argument group. A command that cannot use every packing (kvlab eval's
    reference caches need dense or GGUF blocks) narrows `weights`; the help lists only those.
    """
    parser.add_argument("--weights", default=weights_default, choices=weights,
                        help=f"how a GGUF's matrices are computed on (default {weights_default}). {weights_help(weights)}")
    if dtype:
        parser.add_argument("--dtype", default="fp32", choices=ACTIVATION_DTYPES, help="activation dtype (default fp32)")
    parser.add_argument("--threads", type=positive_int,
                        help="torch CPU threads for every step (default: all of them, or one for the kinds of "
                             "step where one has been faster lately, as on a shared machine: kvlab.nn.threads)")


def _int_at_least(text: str, least: int, kind: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def _float_from(text: str, positive: bool) -> float:
    kind = "positive" if positive else "non-negative"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 if positive else value >= 0):  # nan fails both
        raise argparse.ArgumentTypeError(f"expected a {kind} number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _float_from(text, positive=True)


def non_negative_float(text: str) -> float:
    return _float_from(text, positive=False)


def byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except PlanError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def comma_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers (batch sizes, contexts, concurrency levels, lengths)."""
    try:
        values = [int(item) for item in comma_list(text)]
    except (ValueError, argparse.ArgumentTypeError):
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,4,16, got {text!r}")
    return values


def unit_interval(text: str) -> float:
    """A number in (0, 1]: a probability as --top-p takes it (vLLM's range), a fraction of a cache."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value
