"""The sm90 per-call chunk index, built on the device without a host sync (CPU check)."""

from __future__ import annotations

import pytest
import torch

from flash_qla.utils import prepare_chunk_indices, prepare_chunk_offsets
from flash_qla_tl.layout import dense_layout, varlen_layout

CU_SEQLENS = {
    "empty-first": [0, 0, 64],
    "empty-last": [0, 64, 64],
    "odd-with-padding": [0, 1, 63, 63, 138, 268],
    "one-token": [0, 1],
}


@pytest.mark.parametrize("cu", CU_SEQLENS.values(), ids=CU_SEQLENS.keys())
def test_varlen_layout_matches_the_utils(cu):
    cu_t = torch.tensor(cu, dtype=torch.int32)
    num_tokens = cu[-1] + 7                                # padding tokens after the end
    layout = varlen_layout(cu_t, num_tokens)
    real = prepare_chunk_indices(cu_t, 64)                 # [NT, 2]
    offsets, total = prepare_chunk_offsets(cu_t, 64)
    assert layout.num_chunks_max >= total
    assert torch.equal(layout.chunk_idx[:total].long(), real)
    assert bool((layout.chunk_idx[total:] == -1).all())    # unused grid rows are skipped
    assert torch.equal(layout.chunk_offsets.long(), offsets)


def test_dense_layout_is_b_sequences_of_t():
    layout = dense_layout(3, 100, torch.device("cpu"))
    assert layout.cu_seqlens.tolist() == [0, 100, 200, 300]
    assert layout.num_chunks == 6
    assert layout.chunk_idx[:6].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]]
    assert dense_layout(3, 100, torch.device("cpu")) is layout


def test_uncached_builders_exist_for_graph_capture():
    """layout_for uses them while a CUDA graph is being captured."""
    cu = torch.tensor([0, 5, 70], dtype=torch.int32)
    fresh = varlen_layout.__wrapped__(cu, 70)
    assert fresh is not varlen_layout.__wrapped__(cu, 70)
    assert torch.equal(fresh.chunk_idx, varlen_layout(cu, 70).chunk_idx)
    assert dense_layout.__wrapped__(2, 64, torch.device("cpu")).num_chunks == 2


def test_static_layout_is_kept_per_token_count_and_never_replaced():
    """A static offsets tensor keeps one layout per token count (a dense input and a
    padded varlen one share a plan), and a later count never replaces an earlier one
    (a graph may read it); a layout built while capturing is not kept."""
    from flash_qla_tl.layout import static_layout

    cu = torch.tensor([0, 300, 640], dtype=torch.int32)
    first = static_layout(cu, 640, capturing=False)
    padded = static_layout(cu, 704, capturing=False)
    assert static_layout(cu, 640, capturing=True) is first
    assert static_layout(cu, 704, capturing=False) is padded and padded is not first
    in_graph = static_layout(cu, 768, capturing=True)
    assert static_layout(cu, 768, capturing=False) is not in_graph
    assert first.num_chunks_max < padded.num_chunks_max
