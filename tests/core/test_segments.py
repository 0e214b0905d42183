"""Segment-parallel forward vs the unsplit forward, both on the torch backend in fp64."""

from __future__ import annotations

import doctest
import functools

import pytest
import torch
import torch.nn.functional as F

from flash_qla import segments
from flash_qla.reference import TORCH_KERNELS
from tests.helpers import rel_l2

# name: (lens or None for dense, B, T, Hk, Hv, segment_len, h0, gate)
CASES = {
    "dense-B2-T300-seg64": (None, 2, 300, 1, 2, 64, True, "typical"),
    "dense-B1-T257-seg128-gva4": (None, 1, 257, 1, 4, 128, False, "typical"),
    "varlen-mixed-seg64": ([200, 0, 1, 64, 130], 1, 400, 2, 4, 64, True, "typical"),
    "varlen-pad-seg192": ([500, 3], 1, 510, 1, 2, 192, True, "zero"),
    "varlen-long-short-seg64-strong": ([700, 5, 70], 1, 775, 2, 2, 64, True, "strong"),
}


def _inputs(lens, B, T, Hk, Hv, h0, gate, K=16, V=8):
    gen = torch.Generator().manual_seed(len(str(lens)) + T)
    f64 = dict(dtype=torch.float64)
    q = F.normalize(torch.randn(B, T, Hk, K, generator=gen, **f64), dim=-1)
    k = F.normalize(torch.randn(B, T, Hk, K, generator=gen, **f64), dim=-1)
    v = torch.randn(B, T, Hv, V, generator=gen, **f64)
    beta = torch.rand(B, T, Hv, generator=gen, **f64)
    g = {"zero": torch.zeros(B, T, Hv, **f64),
         "typical": F.logsigmoid(torch.randn(B, T, Hv, generator=gen, **f64)),
         "strong": -30 * torch.rand(B, T, Hv, generator=gen, **f64)}[gate]
    bounds = ([b * T for b in range(B + 1)] if lens is None
              else [0, *torch.tensor(lens).cumsum(0).tolist()])
    N = len(bounds) - 1
    s0 = torch.randn(N, Hv, K, V, generator=gen, **f64) if h0 else None
    return q, k, v, g, beta, s0, bounds


class _PreparedKernels:
    """The torch backend plus ``fwd_prepared``. The raw gate is rebuilt from the g_cumsum
    it is handed (chunk-local: g = its difference inside each chunk of the segments),
    the A it is handed must equal the one ``fwd`` computes from that gate, and then the
    torch ``fwd`` runs: a wrong g_cumsum or A fails the comparison with the unsplit
    forward or this check."""

    fwd = staticmethod(TORCH_KERNELS.fwd)

    def __init__(self):
        self.prepared_calls = 0

    def fwd_prepared(self, q, k, v, g_cumsum, beta, A, *, cu_seqlens_cpu, **kw):
        self.prepared_calls += 1
        chunk_start = torch.zeros(q.shape[1], dtype=torch.bool)
        for bos, eos in zip(cu_seqlens_cpu[:-1].tolist(), cu_seqlens_cpu[1:].tolist()):
            chunk_start[bos:eos:64] = True                              # C = 64
        prev = torch.cat([g_cumsum.new_zeros(1, 1, g_cumsum.shape[2]), g_cumsum[:, :-1]], 1)
        g = g_cumsum - torch.where(chunk_start[None, :, None], 0.0, prev)  # [1,T,Hv]
        out = self.fwd(q, k, v, g, beta, cu_seqlens_cpu=cu_seqlens_cpu, **kw)
        assert torch.allclose(out[1], A, rtol=0, atol=1e-12)
        return out[2:]


@pytest.mark.parametrize("prepared", [False, True], ids=["fwd", "fwd_prepared"])
@pytest.mark.parametrize("spec", CASES.values(), ids=CASES.keys())
def test_segmented_forward_equals_unsplit(spec, prepared):
    lens, B, T, Hk, Hv, seg_len, h0, gate = spec
    q, k, v, g, beta, s0, bounds = _inputs(lens, B, T, Hk, Hv, h0, gate)
    packed = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    cu = torch.tensor(bounds, dtype=torch.int32)
    ref = TORCH_KERNELS.fwd(*packed, scale=0.3, initial_state=s0, cu_seqlens=cu,
                            cu_seqlens_cpu=cu, output_final_state=True, output_h=True)
    kernels = _PreparedKernels() if prepared else TORCH_KERNELS
    ours = segments.segmented_fwd(kernels, *packed, scale=0.3, initial_state=s0,
                                  bounds=bounds, output_final_state=True, output_h=True,
                                  segment_len=seg_len)
    if prepared:                                   # transitions (K / V runs) + output
        assert kernels.prepared_calls == -(-k.shape[-1] // v.shape[-1]) + 1
    for name, a, b in zip(("g_cumsum", "A", "o", "h", "final_state"), ours, ref):
        assert a.shape == b.shape, name
        assert rel_l2(a, b) < 1e-10, name


def test_segment_bounds_doctest():
    assert doctest.testmod(segments).failed == 0


def test_segment_bounds_keep_empty_sequences_empty():
    seg, first = segments.segment_bounds([0, 0, 130, 130], 64)
    assert seg == [0, 64, 128, 130]
    assert first == [0, 0, 3, 3]


def test_a_batch_without_tokens_is_not_split():
    q, k, v, g, beta, s0, _ = _inputs([0], 1, 4, 1, 2, True, "typical")
    out = segments.segmented_fwd(TORCH_KERNELS, q, k, v, g, beta, scale=0.3,
                                 initial_state=s0, bounds=[0, 0], output_final_state=True,
                                 output_h=False, segment_len=64)
    assert torch.count_nonzero(out[2]) == 0          # o: every token is padding
    assert torch.equal(out[4], s0)


def test_repeated_lengths_reuse_the_plan():
    """The same lengths and segment_len again: the split plan (offsets, scan indices)
    comes from the cache, and the result is identical."""
    q, k, v, g, beta, s0, bounds = _inputs([200, 0, 130], 1, 330, 1, 2, True, "typical")
    run = functools.partial(segments.segmented_fwd, TORCH_KERNELS, q, k, v, g, beta,
                            scale=0.3, initial_state=s0, bounds=bounds,
                            output_final_state=True, output_h=False, segment_len=64)
    first = run()
    hits = segments._plan.cache_info().hits
    again = run()
    assert segments._plan.cache_info().hits == hits + 1
    for a, b in zip(first, again):
        assert (a is None and b is None) or torch.equal(a, b)
