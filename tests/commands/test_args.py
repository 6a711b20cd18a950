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
