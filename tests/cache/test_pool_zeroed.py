"""The paged pool's big tensors come from anonymous memory: zeros, writable, exactly the planned bytes."""

import torch

from kvlab.cache.pool import LAZY_ZEROS_BYTES, zeroed


def test_big_cpu_tensors_are_lazily_zeroed_and_writable():
    shape = (64, 3, 16, 512)  # 6 MiB of fp32
    tensor = zeroed(shape, torch.float32, torch.device("cpu"))
    assert tensor.shape == shape and tensor.dtype == torch.float32
    assert tensor.nbytes == 64 * 3 * 16 * 512 * 4 > LAZY_ZEROS_BYTES
    assert torch.count_nonzero(tensor) == 0
    tensor[5, 1, 3] = 2.5
    assert tensor.sum() == 2.5 * 512


def test_small_tensors_and_int8_fields_keep_torch_zeros():
    small = zeroed((2, 2), torch.int8, torch.device("cpu"))
    assert small.dtype == torch.int8 and torch.count_nonzero(small) == 0
    big = zeroed((1 << 21,), torch.int8, torch.device("cpu"))
    assert big.nbytes == 1 << 21 and torch.count_nonzero(big) == 0
