"""flash_qla.utils: known values, tensor_cache by identity, and the module's doctests."""

from __future__ import annotations

import doctest

import pytest
import torch

from flash_qla import utils
from flash_qla.utils import (
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_lens,
    tensor_cache,
)

# name -> (cu_seqlens, chunk size, expected chunk indices, expected chunk offsets)
KNOWN = {
    "empty-then-full": ([0, 0, 64], 64, [[1, 0]], [0, 0, 1]),
    "full-then-empty": ([0, 64, 64], 64, [[0, 0]], [0, 1, 1]),
    "len1-odd-empty-tail": (
        [0, 1, 130, 130, 200], 64,
        [[0, 0], [1, 0], [1, 1], [1, 2], [3, 0], [3, 1]],
        [0, 1, 4, 4, 6],
    ),
    "chunk4": ([0, 3, 3, 10], 4, [[0, 0], [2, 0], [2, 1]], [0, 1, 1, 3]),
    "single-empty": ([0, 0], 64, [], [0, 0]),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_prepare_lens_known_values(dtype):
    lens = prepare_lens(torch.tensor([0, 5, 5, 12], dtype=dtype))
    assert lens.dtype == dtype
    assert lens.tolist() == [5, 0, 7]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("name", list(KNOWN))
def test_prepare_chunk_indices_known_values(name, dtype):
    cu, chunk, expected, _ = KNOWN[name]
    indices = prepare_chunk_indices(torch.tensor(cu, dtype=dtype), chunk)
    assert indices.dtype == dtype                     # cu_seqlens' dtype, as FlashQLA 0.1.3
    assert indices.shape == (len(expected), 2)
    assert indices.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("name", list(KNOWN))
def test_prepare_chunk_offsets_known_values(name, dtype):
    cu, chunk, expected_indices, expected = KNOWN[name]
    offsets, total = prepare_chunk_offsets(torch.tensor(cu, dtype=dtype), chunk)
    assert offsets.dtype == dtype                     # cu_seqlens' dtype, as FlashQLA 0.1.3
    assert offsets.tolist() == expected
    assert isinstance(total, int) and total == len(expected_indices)


@pytest.mark.parametrize("fn", [prepare_chunk_indices, prepare_chunk_offsets],
                         ids=["indices", "offsets"])
def test_nonpositive_chunk_size_rejected(fn):
    with pytest.raises(ValueError, match="chunk_size must be positive; got 0"):
        fn(torch.tensor([0, 4]), 0)


def _counting_cache():
    calls = []

    @tensor_cache
    def fn(x, scale=1):
        calls.append(1)
        return x.sum() * scale

    return fn, calls


def test_tensor_cache_hit_on_same_object():
    fn, calls = _counting_cache()
    a = torch.arange(4)
    first = fn(a)
    assert fn(a) is first
    assert len(calls) == 1


def test_tensor_cache_miss_on_equal_other_object():
    fn, calls = _counting_cache()
    a = torch.arange(4)
    fn(a)
    fn(a.clone())
    assert len(calls) == 2


def test_tensor_cache_keeps_only_most_recent():
    fn, calls = _counting_cache()
    a, b = torch.arange(4), torch.arange(5)
    fn(a), fn(b), fn(b), fn(a)
    assert len(calls) == 3


def test_tensor_cache_miss_on_other_non_tensor_argument():
    fn, calls = _counting_cache()
    a = torch.arange(4)
    fn(a, scale=2), fn(a, scale=2), fn(a, scale=3), fn(a, 3)
    assert len(calls) == 3  # keyword vs positional counts as a different call


def test_tensor_cache_miss_after_in_place_edit():
    fn, calls = _counting_cache()
    a = torch.arange(4)
    fn(a)
    a.add_(1)
    assert fn(a).item() == 10
    assert len(calls) == 2


def test_tensor_cache_works_on_inference_tensors():
    fn, calls = _counting_cache()
    with torch.inference_mode():
        a = torch.arange(4)
        fn(a), fn(a)
    assert len(calls) == 1


def test_prepare_functions_are_cached():
    cu = torch.tensor([0, 3, 10])
    assert prepare_chunk_indices(cu, 4) is prepare_chunk_indices(cu, 4)


def test_doctests():
    result = doctest.testmod(utils, raise_on_error=False, verbose=False)
    assert result.attempted >= 4
    assert result.failed == 0
