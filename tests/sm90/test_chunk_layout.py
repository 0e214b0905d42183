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


def test_layout_follows_an_inference_tensor_refilled_in_place():
    """An engine refilling one offsets tensor in place under ``torch.inference_mode``
    (no version counter to notice it) gets the layout of what the tensor holds now; a
    tensor with a version counter keeps its cached layout until it changes."""
    from flash_qla_sm90.arch import SM90
    from flash_qla_tl.layout import layout_for

    q = torch.empty(1, 256, 1, 128)
    with torch.inference_mode():
        cu = torch.tensor([0, 64, 128], dtype=torch.int32)
        assert layout_for(q, cu, SM90).chunk_offsets.tolist() == [0, 1, 2]
        cu.copy_(torch.tensor([0, 130, 256], dtype=torch.int32))
        assert layout_for(q, cu, SM90).chunk_offsets.tolist() == [0, 3, 5]
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    first = layout_for(q, cu, SM90)
    assert layout_for(q, cu, SM90) is first                # cached while unchanged
    cu.copy_(torch.tensor([0, 130, 256], dtype=torch.int32))
    assert layout_for(q, cu, SM90).chunk_offsets.tolist() == [0, 3, 5]


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


def _device_cases():
    """Offsets for the device kernels: the CPU cases, no sequence at all, more sequences
    than the layout kernel's threads (empty ones among them), one long sequence."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 200, (1500,), generator=gen)
    lens[::7] = 0
    many = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).tolist()
    return {**CU_SEQLENS, "none": [0], "many": many, "long": [0, 100_000]}


DEVICE_CU_SEQLENS = _device_cases()


@pytest.mark.sm90
@pytest.mark.parametrize("pad", [0, 7])
@pytest.mark.parametrize("cu", DEVICE_CU_SEQLENS.values(), ids=DEVICE_CU_SEQLENS.keys())
def test_layout_kernel_matches_the_host_formula(cu, pad):
    """``chunk_layout_kernel`` (one launch) builds the layout the torch formula builds on
    the host, for the arch the GPU tests serve (SM90, or a proof build)."""
    from flash_qla_sm90.arch import served_arch

    cu_t = torch.tensor(cu, dtype=torch.int32)
    host = varlen_layout.__wrapped__(cu_t, cu[-1] + pad)
    device = varlen_layout.__wrapped__(cu_t.cuda(), cu[-1] + pad, served_arch())
    assert device.num_chunks_max == host.num_chunks_max
    assert torch.equal(device.chunk_offsets.cpu(), host.chunk_offsets)
    assert torch.equal(device.chunk_idx.cpu(), host.chunk_idx)


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("end", [0, 1, 37, 100])
def test_padding_rows_are_zeroed_on_the_device(dtype, end):
    """Device offsets only (``cu_seqlens_cpu`` None): ``zero_padding`` zeroes every
    token's row from ``cu_seqlens[-1]`` on (``zero_tail_kernel``) along the token
    dimension given, and leaves the real tokens' rows as they were; the allocator's
    outputs get those zeros."""
    from flash_qla_sm90.arch import served_arch
    from flash_qla_tl.layout import output_alloc, padding_start, zero_padding

    Tt, arch = 100, served_arch()
    cu = torch.tensor([0, end // 2, end], dtype=torch.int32, device="cuda")
    layout = varlen_layout.__wrapped__(cu, Tt, arch)
    assert padding_start(layout, None, Tt) == -1
    assert padding_start(layout, cu.cpu(), Tt) == (None if end == Tt else end)
    alloc = output_alloc(layout, None, Tt, arch=arch)
    for shape, token_dim in (((Tt, 3, 128), 0), ((2, Tt, 4, 128), 1), ((Tt, 6), 0)):
        x = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        zero_padding(x, -1, layout, arch=arch, token_dim=token_dim)
        assert bool((x.narrow(token_dim, end, Tt - end) == 0).all()), (shape, end)
        assert bool(x.narrow(token_dim, 0, end).isnan().all()), (shape, end)
        y = alloc(*shape, dtype=dtype, device=torch.device("cuda"), token_dim=token_dim)
        assert bool((y.narrow(token_dim, end, Tt - end) == 0).all()), (shape, end)
