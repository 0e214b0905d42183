"""Segment-parallel forward vs the unsplit forward, both on the torch backend in fp64."""

from __future__ import annotations

import doctest
import functools
import math

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


# --------------------------------------------------------------------------------------
# The bounded split (warm-up walks): starts, and the torch backend's fwd_warmup
# --------------------------------------------------------------------------------------

def _chunk_cumsum_args(g, bounds):
    """Arguments of a torch forward whose g_cumsum is the chunk-local cumsum of g."""
    T, Hv = g.shape[1:]
    z = torch.zeros(1, T, 1, 4, dtype=torch.float64)
    cu = torch.tensor(bounds, dtype=torch.int32)
    return (z, z, torch.zeros(1, T, Hv, 4, dtype=torch.float64), g,
            torch.zeros(1, T, Hv, dtype=torch.float64)), dict(
        scale=1.0, initial_state=None, cu_seqlens=cu, cu_seqlens_cpu=cu,
        output_final_state=False, output_h=False)


def _walks_of(rule, g, bounds, segment_len, bound):
    """``rule`` (``segments.warmup_starts`` or ``warmup_ends``) on the chunk-local
    cumsum of ``g``, as nested lists ``[Nseg][Hv]``."""
    args, kw = _chunk_cumsum_args(g, bounds)
    gc = TORCH_KERNELS.fwd(*args, **kw)[0]
    plan = segments._plan(tuple(bounds), segment_len, g.device)
    return [x.tolist() for x in rule(gc, plan, bound)]


_starts_of = functools.partial(_walks_of, segments.warmup_starts)


def test_warmup_walks_back_until_the_decay_reaches_the_bound():
    """Chunks decaying by e^-1 (head 0) and e^-3 (head 1), bound e^-2.5, segments of two
    chunks: head 0 walks back 3 chunks, head 1 one; never past its sequence's start (where
    it starts from the sequence's initial state); g = 0 (head 2) always walks to it."""
    per_token = torch.tensor([-1.0, -3.0, 0.0], dtype=torch.float64) / 64
    bounds = [0, 640, 640, 700]                  # 10 chunks, an empty sequence, a short one
    g = per_token.expand(1, 700, 3).contiguous()
    walk, h0_from = _starts_of(g, bounds, 128, math.exp(-2.5))
    # segments: [0,128) [128,256) [256,384) [384,512) [512,640) [640,700)
    assert [w[0] for w in walk] == [0, 0, 64, 192, 320, 640]
    assert [w[1] for w in walk] == [0, 64, 192, 320, 448, 640]
    assert [w[2] for w in walk] == [0, 0, 0, 0, 0, 640]
    assert [f[0] for f in h0_from] == [0, 0, -1, -1, -1, 2]
    assert [f[1] for f in h0_from] == [0, -1, -1, -1, -1, 2]
    assert [f[2] for f in h0_from] == [0, 0, 0, 0, 0, 2]


def test_warmup_treats_positive_gates_as_zero():
    """A gate above 0 counts as no decay: the walk goes on past its chunk (here segment
    2 walks over the growing chunk 1 to chunk 0) instead of stopping early."""
    g = torch.full((1, 256, 1), -4.0 / 64, dtype=torch.float64)
    g[:, 64:128] = 1.0                                             # chunk 1 grows
    walk, _ = _starts_of(g, [0, 256], 64, math.exp(-3.0))
    assert [w[0] for w in walk] == [0, 0, 0, 128]


def _api_split(inputs, bounds, bound, segment_len):
    import flash_qla

    q, k, v, g, beta, s0 = inputs
    cu = torch.tensor(bounds, dtype=torch.int32)
    return flash_qla.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True,
        cu_seqlens=cu, cu_seqlens_cpu=cu, segment_len=segment_len,
        segment_shortcut_bound=bound, backend="torch")


@pytest.mark.parametrize("gate", ["zero", "typical", "strong"])
def test_bounded_split_is_within_its_bound(gate):
    """The bounded split (torch fwd_warmup) against the exact recurrence: g = 0 walks
    whole histories (exact); otherwise the error is at most about the bound, and a
    smaller bound gives a smaller error."""
    lens = [700, 0, 5, 70]
    q, k, v, g, beta, s0, bounds = _inputs(lens, 1, 775, 2, 4, True, gate)
    inputs = (q, k, v, g, beta, s0)
    exact = _api_split(inputs, bounds, 0.0, 64)
    for bound, tol in ((2.0 ** -9, 4e-3), (2.0 ** -30, 1e-8)):
        o, ht = _api_split(inputs, bounds, bound, 64)
        err = max(rel_l2(o, exact[0]), rel_l2(ht, exact[1]))
        if gate == "zero":
            assert err < 1e-12
        else:
            assert err < tol, (bound, err)


@pytest.mark.parametrize("gate", ["zero", "typical"])
def test_bounded_split_of_a_dense_batch(gate):
    """A dense ``[B, T]`` batch reaches the backend's ``fwd_warmup`` as it is (B T tokens
    taken as packed, outputs back in ``[B, T]``; the torch reference views it as one
    packed row itself): equal to the exact recurrence (g = 0: the walks reach every
    sequence's start) or within the bound, o and final state in the batch's shapes."""
    import flash_qla

    q, k, v, g, beta, s0, _ = _inputs(None, 3, 200, 1, 2, True, gate)
    kw = dict(scale=0.3, initial_state=s0, output_final_state=True, backend="torch")
    o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, segment_len=64, **kw)
    exact_o, exact_ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o.shape == v.shape and ht.shape == s0.shape
    err = max(rel_l2(o, exact_o), rel_l2(ht, exact_ht))
    assert err < (1e-12 if gate == "zero" else 4e-3), err


def test_bounded_split_drops_history_where_the_gates_decay():
    """With typical gates over 700 tokens some segment walks start after their
    sequence's start (the shortcut is taken), and the result still matches."""
    q, k, v, g, beta, s0, bounds = _inputs([700], 1, 700, 1, 2, True, "typical")
    walk, h0_from = _starts_of(g, bounds, 64, 2.0 ** -9)
    assert any(f < 0 for row in h0_from for f in row)
    assert all(w % 64 == 0 for row in walk for w in row)


def _random_split(seed: int, empty: int):
    """A random packed batch for the walk rules: ``(lens, bounds, g [1, T, Hv] fp64,
    bound, segment_len, segment bounds)`` with sequence ``empty`` empty and random
    short ones and tails, gates in (-0.1, 0], bound in (e^-8.5, e^-0.5]."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 900, (5,), generator=gen).tolist()
    lens[empty] = 0
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    g = -torch.rand(1, bounds[-1], 3, generator=gen, dtype=torch.float64) * 0.1
    bound = math.exp(-float(torch.rand((), generator=gen)) * 8 - 0.5)
    segment_len = 64 * int(torch.randint(1, 4, (), generator=gen))
    seg, _ = segments.segment_bounds(bounds, segment_len)
    return lens, bounds, g, bound, segment_len, seg


def _sequence_of(s_bos: int, lens: list[int], bounds: list[int]) -> int:
    """The (non-empty) sequence a segment starting at token ``s_bos`` belongs to."""
    return max(i for i in range(len(lens)) if bounds[i] <= s_bos and lens[i] > 0)


@pytest.mark.parametrize("seed", range(4))
def test_warmup_starts_match_a_walk_chunk_by_chunk(seed):
    """warmup_starts (one searchsorted per head) against walking back chunk by chunk,
    on random lengths (empty, short, tails), gates and bounds."""
    lens, bounds, g, bound, segment_len, seg = _random_split(seed, seed % 5)
    Hv = g.shape[-1]
    walk, h0_from = _starts_of(g, bounds, segment_len, bound)
    expected_walk, expected_from = [], []
    for s_bos in seg[:-1]:
        n = _sequence_of(s_bos, lens, bounds)
        row_w, row_f = [], []
        for h in range(Hv):
            w, acc = s_bos, 0.0
            while w > bounds[n] and acc > math.log(bound):
                w -= 64
                acc += float(g[0, w:w + 64, h].sum())
            row_w.append(w)
            row_f.append(n if w == bounds[n] else -1)
        expected_walk.append(row_w)
        expected_from.append(row_f)
    assert walk == expected_walk
    assert h0_from == expected_from


@pytest.mark.parametrize("seed", range(4))
def test_warmup_ends_match_a_walk_chunk_by_chunk(seed):
    """warmup_ends (the backward's reverse walks) against walking forward chunk by
    chunk from each segment's end, on random lengths, gates and bounds."""
    lens, bounds, g, bound, segment_len, seg = _random_split(seed + 10, seed % 5)
    Hv = g.shape[-1]
    walk_end, dht_from = _walks_of(segments.warmup_ends, g, bounds, segment_len, bound)
    expected_end, expected_from = [], []
    for s_bos, s_eos in zip(seg[:-1], seg[1:]):
        n = _sequence_of(s_bos, lens, bounds)
        row_e, row_f = [], []
        for h in range(Hv):
            e, acc = s_eos, 0.0
            while e < bounds[n + 1] and acc > math.log(bound):
                acc += float(g[0, e:e + 64, h].sum())
                e = min(e + 64, bounds[n + 1])
            row_e.append(e)
            row_f.append(n if e == bounds[n + 1] else -1)
        expected_end.append(row_e)
        expected_from.append(row_f)
    assert walk_end == expected_end
    assert dht_from == expected_from
def test_plans_made_while_capturing_are_kept(monkeypatch):
    """A plan used inside a CUDA-graph capture stays alive (its device tensors and
    staging buffers are read by every replay), even after the LRU cache drops it; one
    first built inside a capture is never handed to an eager call or another capture
    (its data arrives only when its graph replays), while an eagerly built one is
    shared with the captures that follow."""
    monkeypatch.setattr(segments, "_CAPTURED_PLANS", {})
    cpu = torch.device("cpu")
    capturing = {"on": True}
    monkeypatch.setattr(segments, "is_capturing", lambda device: capturing["on"])
    segments._plan.cache_clear()
    in_graph = segments._plan_for([0, 640], 128, cpu)
    again = segments._plan_for([0, 640], 128, cpu)             # another capture
    capturing["on"] = False
    eager = segments._plan_for([0, 640], 128, cpu)
    assert eager is not in_graph and again is not in_graph and eager is not again
    capturing["on"] = True
    assert segments._plan_for([0, 640], 128, cpu) is eager      # built eagerly: shared
    segments._plan.cache_clear()
    assert set(map(id, segments._CAPTURED_PLANS.values())) == {id(in_graph), id(again),
                                                              id(eager)}


@pytest.mark.parametrize("dense, bound, allowed", [(True, 2.0 ** -9, True),
                                                   (True, 0.0, False),
                                                   (False, 2.0 ** -9, False)],
                         ids=["dense-bounded", "dense-exact", "varlen-bounded"])
def test_only_dense_bounded_splits_run_inside_capture(monkeypatch, dense, bound, allowed):
    """Inside a capture, on a backend whose walks are not searched in a kernel (the
    torch backend): the bounded split of a dense input runs (its lengths are the
    shape); the exact split and any varlen split raise a ValueError naming
    segment_len (a replay could bring other lengths, and its plan is the host's)."""
    monkeypatch.setattr(segments, "is_capturing", lambda device: True)
    monkeypatch.setattr(segments, "_CAPTURED_PLANS", {})
    q, k, v, g, beta, s0, bounds = _inputs(None if dense else [200, 100], 1, 300, 1, 2,
                                           True, "typical")
    cu = None if dense else torch.tensor(bounds, dtype=torch.int32)
    run = functools.partial(
        segments.fwd_with_segments, TORCH_KERNELS, q, k, v, g, beta, scale=0.3,
        initial_state=s0, cu_seqlens=cu, cu_seqlens_cpu=cu, output_final_state=True,
        output_h=False, segment_len=128, shortcut_bound=bound)
    if allowed:
        o = run()[2]
        assert torch.isfinite(o).all() and len(segments._CAPTURED_PLANS) == 1
    else:
        with pytest.raises(ValueError, match="segment_len"):
            run()


@pytest.mark.parametrize("lens, segment_len", [([200, 0, 1, 64, 130], 64),
                                                ([0, 0, 700], 128), ([5], 64),
                                                ([256, 512, 3, 0], 256), ([0], 64)])
def test_device_plan_matches_the_host_plan(lens, segment_len):
    """The split laid out on the device from live offsets (a captured varlen batch)
    lists the host plan's segments, with their sequences and starts, then empty ones
    at the batch's end up to its host-known size, which walk nothing; each sequence's
    last segment and segment count are the host plan's."""
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    host = segments._plan(tuple(bounds), segment_len, torch.device("cpu"))
    pad = 7                                           # tokens after the last sequence
    dev = segments._device_plan(torch.tensor(bounds, dtype=torch.int32), bounds[-1] + pad,
                                segment_len)
    nseg, slots = host.num_segments, dev.seg_seq.numel()
    assert slots == -(-(bounds[-1] + pad) // segment_len) + len(lens) >= nseg
    assert dev.cu.dtype == torch.int32 and dev.cu[:nseg + 1].tolist() == host.cu_cpu.tolist()
    assert dev.cu[nseg + 1:].tolist() == [bounds[-1]] * (slots - nseg)   # empty segments
    assert dev.seg_seq[:nseg].tolist() == host.seg_seq.tolist()
    assert dev.seg_seq_start[:nseg].tolist() == host.seg_seq_start.tolist()
    # an empty segment's sequence "starts" at it: the kernel's walk search has no chunk
    # to walk back over (else each would re-run the last sequence's tail for nothing)
    assert dev.seg_seq_start[nseg:].tolist() == [bounds[-1]] * (slots - nseg)
    assert dev.last_seg.tolist() == host.last_seg.tolist()
    assert dev.ends.tolist() == host.ends.tolist()


class _DeviceSearch:
    """The torch backend as one that searches its walks in the kernel
    (``searches_walks``): ``fwd_warmup`` must get a device plan and no host offsets; it
    runs the reference split on the host plan of the lengths the test gives it (what the
    device plan's live segments must be: the test above) and pads the final states of
    the device plan's empty segments with NaN (the core must never read them)."""

    fwd = staticmethod(TORCH_KERNELS.fwd)
    searches_walks = True

    def __init__(self, bounds, segment_len):
        self.host = segments._plan(tuple(bounds), segment_len, torch.device("cpu"))
        self.plans = []

    def fwd_warmup(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
                   cu_seqlens_cpu, starts):
        assert cu_seqlens_cpu is None and isinstance(starts.plan, segments._DevicePlan)
        self.plans.append(starts.plan)
        g_cumsum, A, o, final = TORCH_KERNELS.fwd_warmup(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            cu_seqlens=self.host.cu, cu_seqlens_cpu=self.host.cu_cpu,
            starts=segments.WalkStarts(self.host, starts.bound))
        empty = cu_seqlens.numel() - 1 - final.shape[0]
        return g_cumsum, A, o, torch.cat([final, final.new_full((empty, *final.shape[1:]),
                                                               math.nan)])


@pytest.mark.parametrize("lens", [[200, 0, 1, 64, 130], [0, 300]], ids=["mixed", "empty-first"])
def test_captured_varlen_bounded_split_is_laid_out_on_the_device(monkeypatch, lens):
    """Inside a capture, a varlen batch on a backend that searches its walks in the
    kernel is split by a plan laid out on the device (no host offsets, empty segments
    at the end): o and the final states equal the host-planned split's, including an
    empty sequence's (its initial state)."""
    q, k, v, g, beta, s0, bounds = _inputs(lens, 1, 400, 2, 4, True, "typical")
    cu = torch.tensor(bounds, dtype=torch.int32)
    run = functools.partial(segments.fwd_with_segments, q=q, k=k, v=v, g=g, beta=beta,
                            scale=0.3, initial_state=s0, cu_seqlens=cu,
                            output_final_state=True, output_h=False, segment_len=64,
                            shortcut_bound=2.0 ** -9)
    want = run(TORCH_KERNELS, cu_seqlens_cpu=cu)
    kernels = _DeviceSearch(bounds, 64)
    monkeypatch.setattr(segments, "is_capturing", lambda device: True)
    monkeypatch.setattr(segments, "host_bounds", None)          # no host lengths used
    got = run(kernels, cu_seqlens_cpu=None)
    assert len(kernels.plans) == 1
    assert torch.equal(got[2], want[2]) and torch.equal(got[4], want[4])


class _RecordingBwd:
    """A backend stand-in for ``warmup_bwd``: its ``bwd_warmup`` returns gradients of
    the packed shapes and, as dh0, each segment's index (so the selection is visible)."""

    def __init__(self):
        self.calls = []

    def bwd_warmup(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state,
                   cu_seqlens, cu_seqlens_cpu, starts, ends, states=None):
        self.calls.append(dict(cu=cu_seqlens_cpu.tolist(), starts=starts, ends=ends,
                               states=states))
        nseg = len(cu_seqlens_cpu) - 1
        dh0 = torch.arange(nseg, dtype=torch.float32).view(nseg, 1, 1, 1).expand(
            nseg, *initial_state.shape[1:]).clone()
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                torch.zeros_like(beta), torch.zeros_like(g_cumsum), dh0)


def test_bounded_backward_takes_each_sequences_first_segment():
    """warmup_bwd runs the backend's bwd_warmup on the plan's segments with the forward's
    walk rule, and returns per sequence the dh0 of its first segment; an empty sequence
    gets dht (or zeros without dht), as the unsplit backward would give it."""
    bounds = [0, 300, 300, 450]                      # segments of 128: 3 + 0 + 2
    T, Hv, K, V = 450, 2, 4, 4
    q = torch.zeros(1, T, 1, K)
    v = torch.zeros(1, T, Hv, V)
    gt = torch.zeros(1, T, Hv)
    h0 = torch.zeros(3, Hv, K, V)
    cu = torch.tensor(bounds, dtype=torch.int32)
    kernels = _RecordingBwd()
    for dht, empty_fill in ((None, 0.0), (torch.full((3, Hv, K, V), 7.0), 7.0)):
        *grads, dh0 = segments.warmup_bwd(
            kernels, q, q, v, gt, gt, torch.zeros(1, T, Hv, 64), v, dht=dht, scale=1.0,
            initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu, segment_len=128,
            shortcut_bound=2.0 ** -9)
        call = kernels.calls[-1]
        assert call["cu"] == [0, 128, 256, 300, 428, 450]
        assert call["starts"].bound == 2.0 ** -9 and call["starts"].seq_index.tolist() == [
            0, 0, 0, 2, 2]
        assert [x.shape for x in grads] == [q.shape, q.shape, v.shape, gt.shape, gt.shape]
        assert dh0[:, 0, 0, 0].tolist() == [0.0, empty_fill, 3.0]


class _StateKeepingWarmup(_RecordingBwd):
    """A backend stand-in with ``keeps_states``: ``fwd_warmup`` returns zeros and, when
    asked to keep states, a marker tensor as its fifth element."""

    keeps_states = True

    def fwd_warmup(self, q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
                   cu_seqlens_cpu, starts, **keep):
        self.keep = keep
        nseg, (Hv, V) = len(cu_seqlens_cpu) - 1, v.shape[2:]
        outs = (torch.zeros_like(g), torch.zeros(*g.shape, 64), torch.zeros_like(v),
                torch.zeros(nseg, Hv, q.shape[3], V))
        return (*outs, torch.full((1,), 5.0)) if keep.get("keep_states") else outs


@pytest.mark.parametrize("keeps", [True, False])
def test_bounded_split_hands_kept_states_to_its_backward(keeps):
    """fwd_with_segments(keep_states=True) asks a backend with ``keeps_states`` for them
    and returns them in h's place; warmup_bwd hands them to ``bwd_warmup``. A backend
    without ``keeps_states`` is not asked (its fwd_warmup takes no such keyword)."""
    T, Hv, K, V = 300, 2, 4, 4
    q, v, g = torch.zeros(1, T, 1, K), torch.zeros(1, T, Hv, V), torch.zeros(1, T, Hv)
    kernels = _StateKeepingWarmup()
    kernels.keeps_states = keeps
    *_, states, _ = segments.fwd_with_segments(
        kernels, q, q, v, g, g, scale=1.0, initial_state=None, cu_seqlens=None,
        cu_seqlens_cpu=None, output_final_state=False, output_h=False, segment_len=128,
        shortcut_bound=2.0 ** -9, keep_states=True)
    assert kernels.keep == ({"keep_states": True} if keeps else {})
    assert (states is not None and states.tolist() == [5.0]) if keeps else states is None
    segments.warmup_bwd(kernels, q, q, v, g, g, torch.zeros(1, T, Hv, 64), v, dht=None,
                        scale=1.0, initial_state=torch.zeros(1, Hv, K, V), cu_seqlens=None,
                        cu_seqlens_cpu=None, segment_len=128, shortcut_bound=2.0 ** -9,
                        states=states)
    assert kernels.calls[-1]["states"] is states


def test_consecutive_rows_are_taken_by_a_view():
    """A split of one sequence (or of sequences whose last / first segments are
    consecutive rows) takes each sequence's final state and dh0 rows by a view, not a
    gather: the same values, no copy."""
    from flash_qla.segments import _plan, _rows, _run_start

    assert _run_start([3]) == 3 and _run_start([2, 3, 4]) == 2
    assert _run_start([0, 2]) == -1 and _run_start([]) == -1
    x = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)
    index = torch.tensor([2, 3])
    view = _rows(x, index, 2, 2)
    assert torch.equal(view, x.index_select(0, index)) and view.data_ptr() == x[2].data_ptr()
    assert torch.equal(_rows(x, torch.tensor([0, 4]), -1, 2), x[[0, 4]])
    one = _plan((0, 1000), 256, torch.device("cpu"))                  # 4 segments
    assert (one.last_run, one.first_run) == (one.num_segments - 1, 0)
    two = _plan((0, 1000, 1100), 256, torch.device("cpu"))            # 4 + 1 segments
    assert (two.last_run, two.first_run) == (3, -1)
    assert two.last_seg.tolist() == [3, 4] and two.first_seg.tolist() == [0, 4]
