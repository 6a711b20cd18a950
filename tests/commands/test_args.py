"""Shared argument types: lists of positive integers, one parser for every command that takes them."""

import argparse

import pytest

from kvlab.commands.args import positive_int_list


def test_positive_int_list_reads_commas_and_spaces():
    assert positive_int_list("1,4,16") == [1, 4, 16]
    assert positive_int_list(" 16 , 64 ") == [16, 64]


@pytest.mark.parametrize("text", ["", ",", "0", "4,-1", "a", "1.5", "4,,x"])
def test_positive_int_list_refuses_what_is_not_positive_integers(text):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
        positive_int_list(text)


def test_each_commands_weights_help_lists_only_its_own_choices():
    """kvlab eval takes dense/gguf/gguf-a8: its --help must not offer int4 or auto (the shared help once did)."""
    import argparse

    from kvlab.commands.args import add_model_flags
    narrow, full = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_model_flags(narrow, weights=("dense", "gguf", "gguf-a8"), weights_default="dense", dtype=False)
    add_model_flags(full)
    narrow_help, full_help = narrow.format_help(), full.format_help()
    assert "int4:" not in narrow_help and "auto:" not in narrow_help and "gguf-a8:" in narrow_help
    assert "int4:" in full_help and "auto:" in full_help
