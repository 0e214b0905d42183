"""Segment (intra-sequence) parallelism of the forward: exact on any backend's kernels,
or bounded in one pass on backends with ``fwd_warmup``.

A sequence of many chunks walks its chunks serially: with few sequences x few heads
most SMs idle. Split every sequence into segments of ``segment_len`` tokens (a
multiple of C, so chunk boundaries do not move). The chunk update is affine in the
start state (gdn-math.md, "Segment transition")::

    S_out(s) = M_seg(s) S_in(s) + L_seg(s)

and three passes of the backend's own forward, each over all segments in parallel
(the segments passed as packed sequences; the prepare, gate cumsum and inverse, only in
the first when the backend offers ``fwd_prepared``), give the exact result:

1. ``L_seg``: every segment from a zero state (its final state);
2. ``M_seg``: every segment with v = 0 from the identity (``[K, K]`` as the state,
   ``V`` columns per pass), since then ``S_out = M_seg I``;
3. a short sequential scan over the segments of each sequence for the true
   ``S_in``, then the output pass from those states.

With ``shortcut_bound`` 0 there is no gate-driven truncation: the result equals the
unsplit forward up to the rounding of the backend (its states pass through its GEMM
dtype).

The bounded split (``shortcut_bound`` > 0, backends with ``fwd_warmup``) is one pass:
segment s of head h starts its recurrence, from a zero state, at the latest chunk
boundary ``c`` before it whose decay up to the segment, ``exp(sum of g over [c, start))``,
is at or below the bound (:func:`warmup_starts`), and computes the chunks from ``c``
to its start again as a warm-up, storing o only from its start on. What it drops is
``M(c -> start) S(c)``, of norm at most ``bound * ||S(c)||``: each token's factor
``exp(g_t) (I - beta_t k_t k_t^T)`` has norm at most ``exp(g_t)`` while
``beta |k|^2 <= 2`` (L2-normalised keys, beta in [0, 1]) and g <= 0. Where the gates do
not decay that far the walk reaches the sequence start (from its initial state): the
exact recurrence, never an approximation; ``g = 0`` always walks the whole history.
No host sync: the walks are found on the device from the prepare's gate cumsum (by
:func:`warmup_starts`, or by the backend's kernel: :class:`WalkStarts`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import keeps_states, searches_walks
from .offsets import bounds
from .validation import is_capturing

__all__ = ["DEFAULT_SEGMENT_LEN", "DEFAULT_SHORTCUT_BOUND", "WalkEnds", "WalkStarts",
           "fwd_with_segments", "host_bounds", "segment_bounds", "segmented_fwd",
           "uses_warmup", "warmup_bwd", "warmup_ends", "warmup_fwd", "warmup_starts"]

#: Segment length used by ``force_intra_cp=True`` without an explicit ``segment_len``
#: (the fastest of 1024 / 2048 / 4096 on every few-head shape measured on the H200,
#: docs/perf-notes.md "v5").
DEFAULT_SEGMENT_LEN = 4096

#: Default ``segment_shortcut_bound``: what a segment's warm-up may drop, relative to the
#: state it would have carried: 2^-9, below bf16's resolution (2^-8 relative).
DEFAULT_SHORTCUT_BOUND = 2.0 ** -9

#: Tokens per chunk of every backend (segments and walks move by whole chunks).
CHUNK = 64


def host_bounds(B: int, T: int, cu_seqlens: Tensor | None,
                cu_seqlens_cpu: Tensor | None) -> list[int]:
    """Sequence offsets ``[N + 1]`` on the host: ``b * T`` for dense ``[B, T]`` inputs,
    else ``cu_seqlens`` (from ``cu_seqlens_cpu`` when given; otherwise a host sync)."""
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)]
    return bounds(cu_seqlens, cu_seqlens_cpu)


def _with_batch(x: Tensor, B: int, T: int) -> Tensor:
    """``x`` ``[B', T', ...]`` viewed as ``[B, T, ...]`` (B' T' = B T); ``x`` itself when it
    already is (a view op costs host time on every call)."""
    return x if x.shape[:2] == (B, T) else x.reshape(B, T, *x.shape[2:])


def segment_bounds(bounds: list[int], segment_len: int) -> tuple[list[int], list[int]]:
    """Split packed sequences into segments.

    Args:
        bounds: ``[N + 1]`` sequence offsets (``cu_seqlens`` on the host).
        segment_len: tokens per segment (the last segment of a sequence may be shorter).

    Returns ``(seg_bounds, first)``: offsets of the segments (packed, in order) and,
    per sequence, the index of its first segment (``first[N]`` = number of segments).
    Empty sequences own no segment.

    >>> segment_bounds([0, 5, 5, 12], 4)
    ([0, 4, 5, 9, 12], [0, 2, 2, 4])
    """
    seg, first = [bounds[0]], [0]
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        seg.extend(range(bos + segment_len, eos, segment_len))
        if eos > bos:
            seg.append(eos)
        first.append(len(seg) - 1)
    return seg, first


def _to_device(values: list[int], device: torch.device, dtype: torch.dtype,
               staging: list | None = None) -> Tensor:
    """A small host list on ``device`` without a stream synchronisation: staged in
    pinned memory and copied asynchronously (a pageable copy would wait for the GPU and
    serialise this path's host work with the kernels already queued). The pinned buffer
    is appended to ``staging`` when given: a CUDA graph that captured the copy reads it
    again at every replay, so it must outlive the graph."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    pinned = t.pin_memory()
    if staging is not None:
        staging.append(pinned)
    return pinned.to(device, non_blocking=True)


def _identity_columns(n: int, Hv: int, K: int, V: int, start: int, like: Tensor) -> Tensor:
    """``[n, Hv, K, V]``: columns ``start .. start + V`` of the K x K identity (zero
    columns past K)."""
    eye = torch.eye(K, K + V, dtype=torch.float32, device=like.device)   # [K,K+V]
    return eye[:, start:start + V].expand(n, Hv, K, V).contiguous()


def _transitions(recur, v: Tensor, n_seg: int, K: int) -> Tensor:
    """``M_seg`` of every segment ``[Nseg, Hv, K, K]`` (pass 2): ``recur(v, h0)`` from
    the identity's columns with v = 0, ``V`` columns per run."""
    Hv, V = v.shape[2:]
    zero_v = torch.zeros_like(v)
    cols = [recur(zero_v, _identity_columns(n_seg, Hv, K, V, start, v), True, False)[2]
            for start in range(0, K, V)]                                 # [Nseg,Hv,K,V]
    return torch.cat(cols, dim=-1)[..., :K]                              # [Nseg,Hv,K,K]


@dataclass(frozen=True)
class _Plan:
    """A split of packed sequences, with the index tensors its passes and scan read."""
    N: int                  # sequences
    num_segments: int       # Nseg
    J: int                  # most segments of one sequence (scan positions)
    cu: Tensor              # [Nseg+1] int32 on the device: segment offsets
    cu_cpu: Tensor          # the same on the host
    slot: Tensor            # [J, N] long: segment at position j of sequence n, or Nseg
    seg_j: Tensor           # [Nseg] long: each segment's position ...
    seg_n: Tensor           # [Nseg] long: ... and sequence
    ends: Tensor            # [N] long: segments per sequence
    last_seg: Tensor        # [N] long: each sequence's last segment (0 if it has none)
    chunk_last: Tensor      # [NC] long: last token of every chunk of every sequence
    seg_chunk: Tensor       # [Nseg] long: global index of each segment's first chunk
    seq_chunk1: Tensor      # [Nseg] long: 1 + that of its sequence's first chunk
    walk_off: Tensor        # [Nseg] long: its sequence's first token - C * seq_chunk1
    seg_chunk_end: Tensor   # [Nseg] long: global index of the chunk after the segment
    seq_chunk_end: Tensor   # [Nseg] long: ... and after its sequence
    seq_eos: Tensor         # [Nseg] long: its sequence's end token
    first_seg: Tensor       # [N] long: each sequence's first segment (0 if it has none)
    seg_seq_start: Tensor   # [Nseg] int32: its sequence's first token (kernel walks)
    seg_seq: Tensor         # [Nseg] int32: its sequence (seg_n, as the kernels read it)
    seg_seq_end: Tensor     # [Nseg] int32: its sequence's end token (kernel walks)
    any_empty: bool         # a sequence without tokens (its final state is h0 or 0)
    staging: tuple = ()     # pinned host buffers the device tensors were copied from
    last_run: int = -1      # last_seg == range(last_run, last_run + N), else -1 ...
    first_run: int = -1     # ... and first_seg likewise: rows taken by a view, no gather


@functools.lru_cache(maxsize=32)
def _plan(bounds: tuple[int, ...], segment_len: int, device: torch.device) -> _Plan:
    """The split of sequences ``bounds`` (cached: repeated calls with the same lengths,
    a training loop over fixed packing or a benchmark, build and copy nothing)."""
    seg, first = segment_bounds(list(bounds), segment_len)
    N, Nseg = len(first) - 1, len(seg) - 1
    counts = [first[n + 1] - first[n] for n in range(N)]
    J = max(counts, default=0)
    slot = [first[n] + j if j < counts[n] else Nseg for j in range(J) for n in range(N)]
    seg_j = [j for n in range(N) for j in range(counts[n])]
    seg_n = [n for n in range(N) for _ in range(counts[n])]
    last_seg = [max(first[n + 1] - 1, 0) for n in range(N)]
    chunk_last, seq_first_chunk = [], []                  # the chunk grid of the sequences
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        seq_first_chunk.append(len(chunk_last))
        chunk_last.extend(min(t + CHUNK, eos) - 1 for t in range(bos, eos, CHUNK))
    seq_chunk1 = [seq_first_chunk[n] + 1 for n in seg_n]
    seq_bos = [bounds[n] for n in seg_n]
    seg_chunk = [seq_chunk1[i] - 1 + (seg[i] - seq_bos[i]) // CHUNK for i in range(Nseg)]
    walk_off = [seq_bos[i] - CHUNK * seq_chunk1[i] for i in range(Nseg)]
    seg_chunk_end = [seg_chunk[i] + -(-(seg[i + 1] - seg[i]) // CHUNK) for i in range(Nseg)]
    seq_first_chunk.append(len(chunk_last))
    seq_chunk_end = [seq_first_chunk[n + 1] for n in seg_n]
    seq_eos = [bounds[n + 1] for n in seg_n]
    first_seg = [first[n] if counts[n] else 0 for n in range(N)]
    sizes = [J * N, Nseg, Nseg, N, N, len(chunk_last), Nseg, Nseg, Nseg, Nseg, Nseg, Nseg, N]
    staging = []
    index = _to_device(slot + seg_j + seg_n + counts + last_seg + chunk_last + seg_chunk
                       + seq_chunk1 + walk_off + seg_chunk_end + seq_chunk_end + seq_eos
                       + first_seg, device, torch.long, staging)
    slot_t, *rest = index.split(sizes)
    small = _to_device(seg + seq_bos + seg_n + seq_eos, device, torch.int32, staging)
    cu, seq_start, seq, seq_end = small.split([Nseg + 1, Nseg, Nseg, Nseg])   # int32
    return _Plan(N, Nseg, J, cu, torch.tensor(seg, dtype=torch.int32), slot_t.view(J, N),
                 *rest, seg_seq_start=seq_start, seg_seq=seq, seg_seq_end=seq_end,
                 any_empty=min(counts, default=0) == 0, staging=tuple(staging),
                 last_run=_run_start(last_seg), first_run=_run_start(first_seg))


def _run_start(rows: list[int]) -> int:
    """``rows[0]`` when rows are consecutive (``rows[0], rows[0] + 1, ...``: always for
    one sequence), else -1."""
    if rows and all(r == rows[0] + i for i, r in enumerate(rows)):
        return rows[0]
    return -1


def _rows(x: Tensor, index: Tensor, run: int, n: int) -> Tensor:
    """``x.index_select(0, index)`` for an index whose host copy is ``range(run, run +
    n)`` (``run >= 0``): then a view of x (no launch), else the gather."""
    return x[run:run + n] if run >= 0 else x.index_select(0, index)


#: Plans used inside a CUDA-graph capture (by id): a graph reads their device tensors
#: (and re-copies their staging buffers) at every replay, so they are never dropped.
_CAPTURED_PLANS: dict = {}


def _plan_for(bounds: list[int], segment_len: int, device: torch.device) -> _Plan:
    """:func:`_plan`, kept for the process's life when a graph is being captured. A plan
    first built inside a capture holds data only once that graph replays (its copies
    are recorded, not run), so it leaves the cache at once: no eager call and no other
    graph is handed it (they build their own)."""
    if not is_capturing(device):
        return _plan(tuple(bounds), segment_len, device)
    misses = _plan.cache_info().misses
    plan = _plan(tuple(bounds), segment_len, device)
    if _plan.cache_info().misses != misses:          # built inside this capture
        _plan.cache_clear()
    _CAPTURED_PLANS[id(plan)] = plan
    return plan


@dataclass(frozen=True)
class _DevicePlan:
    """What the bounded forward of a backend that searches its walks in the kernel
    (``Kernels.searches_walks``) reads of a :class:`_Plan`, built on the device from
    live offsets: inside a CUDA-graph capture of a varlen batch, whose replays may bring
    other lengths. Its sizes are host-known bounds: ``Smax = ceil(Tt / S) + N`` segment
    slots, the batch's segments first (as :func:`segment_bounds` lists them), then
    empty ones at the batch's end."""
    N: int                  # sequences
    cu: Tensor              # [Smax+1] int32: segment offsets (non-decreasing)
    seg_seq_start: Tensor   # [Smax] int32: its sequence's first token (kernel walks; an
                            # empty segment's own start, so that no walk is searched)
    seg_seq: Tensor         # [Smax] int32: its sequence
    last_seg: Tensor        # [N] long: each sequence's last segment (0 if it has none)
    ends: Tensor            # [N] long: segments per sequence
    cu_cpu: None = None     # no host offsets
    any_empty: bool = True  # unknown on the host: the final-state gather always checks
    last_run: int = -1      # unknown on the host: the final states are gathered


def _device_plan(cu_seqlens: Tensor, num_tokens: int, segment_len: int) -> _DevicePlan:
    """:class:`_DevicePlan` of packed sequences ``cu_seqlens`` ``[N + 1]`` (on the
    device, ``num_tokens`` = Tt) split every ``segment_len`` tokens: device ops only, no
    host sync, so a CUDA graph records them and recomputes the plan at every replay."""
    cu = cu_seqlens.long()                                            # [N+1]
    N = cu.numel() - 1
    counts = (cu[1:] - cu[:-1] + segment_len - 1).div(segment_len, rounding_mode="floor")
    first = torch.zeros(N + 1, dtype=torch.long, device=cu.device)    # [N+1]
    first[1:] = torch.cumsum(counts, 0)                    # each sequence's first segment
    slots = -(-num_tokens // segment_len) + N                         # Smax
    slot = torch.arange(slots, device=cu.device)                      # [Smax]
    seq = torch.searchsorted(first[1:], slot, right=True).clamp_(max=max(N - 1, 0))
    live = slot < first[-1]                                           # [Smax]
    start = torch.where(live, cu[seq] + (slot - first[seq]) * segment_len, cu[-1])
    # an empty segment's "sequence" starts where it does: a kernel walks nothing for it
    seq_start = torch.where(live, cu[seq], cu[-1])
    return _DevicePlan(N, torch.cat([start, cu[-1:]]).int(), seq_start.int(), seq.int(),
                       (first[1:] - 1).clamp_(min=0), counts)


def _scan(M: Tensor, L: Tensor, plan: _Plan, initial_state: Tensor | None,
          ) -> tuple[Tensor, Tensor]:
    """Segment start states ``[Nseg, Hv, K, V]`` and sequence final states ``[N, ...]``.

    ``S_in(first[n]) = h0[n]``; ``S_in(s + 1) = M(s) S_in(s) + L(s)`` within a sequence.
    The segments sit on a grid ``[J, N]`` (position j of sequence n; J = the most
    segments of any sequence), the slots past a sequence's end padded with M = I,
    L = 0, so each position is one batched ``baddbmm`` over every sequence and head:
    J launches in all, the host work independent of N.
    """
    _, Hv, K, V = L.shape
    N, J = plan.N, plan.J
    eye = torch.eye(K, dtype=M.dtype, device=M.device).expand(1, Hv, K, K)
    M_grid = torch.cat([M, eye])[plan.slot].reshape(J, N * Hv, K, K)        # [J,N*Hv,K,K]
    L_grid = torch.cat([L, L.new_zeros(1, Hv, K, V)])[plan.slot].reshape(J, N * Hv, K, V)
    S = L.new_empty(J + 1, N, Hv, K, V)                   # S[j, n] = S_in of position j
    if initial_state is None:
        S[0].zero_()
    else:
        S[0].copy_(initial_state)
    flat = S.view(J + 1, N * Hv, K, V)
    for j in range(J):
        torch.baddbmm(L_grid[j], M_grid[j], flat[j], out=flat[j + 1])     # [N*Hv,K,V]
    return S[plan.seg_j, plan.seg_n], S[plan.ends, torch.arange(N, device=L.device)]


def segmented_fwd(kernels, q, k, v, g, beta, *, scale: float, initial_state: Tensor | None,
                  bounds: list[int], output_final_state: bool, output_h: bool,
                  segment_len: int):
    """``Kernels.fwd`` contract, computed segment-parallel with a backend's ``kernels``
    (``fwd``, and ``fwd_prepared`` when the backend has it: the later passes then reuse
    the first pass's g_cumsum and A instead of recomputing them).

    q, k ``[1, T, Hk, K]``; v ``[1, T, Hv, V]``; g, beta ``[1, T, Hv]``: packed
    sequences with host offsets ``bounds`` (``[N + 1]``; dense inputs are flattened by
    the caller). ``segment_len`` must be a positive multiple of the backend's chunk
    size. Returns ``(g_cumsum, A, o, h, final_state)`` as the unsplit ``fwd`` would.
    """
    if bounds[-1] == bounds[0]:                    # no sequence holds a token: no split
        cu = torch.tensor(bounds, dtype=torch.int32)
        return kernels.fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           cu_seqlens=cu.to(q.device), cu_seqlens_cpu=cu,
                           output_final_state=output_final_state, output_h=output_h)
    plan = _plan(tuple(bounds), segment_len, q.device)
    common = dict(scale=scale, cu_seqlens=plan.cu, cu_seqlens_cpu=plan.cu_cpu)
    g_cumsum, A, _, _, L = kernels.fwd(q, k, v, g, beta, initial_state=None,
                                       output_final_state=True, output_h=False,
                                       **common)                         # L [Nseg,Hv,K,V]
    prepared = getattr(kernels, "fwd_prepared", None)

    def recur(v_, h0, final, h):                   # -> (o, h, final_state) of the segments
        if prepared is not None:
            return prepared(q, k, v_, g_cumsum, beta, A, initial_state=h0,
                            output_final_state=final, output_h=h, **common)
        return kernels.fwd(q, k, v_, g, beta, initial_state=h0, output_final_state=final,
                           output_h=h, **common)[2:]

    M = _transitions(recur, v, plan.num_segments, q.shape[-1])           # [Nseg,Hv,K,K]
    S_in, final_state = _scan(M, L, plan, initial_state)
    o, h, _ = recur(v, S_in.contiguous(), False, output_h)
    return g_cumsum, A, o, h, (final_state if output_final_state else None)


def _decay_before(g_cumsum: Tensor, plan: _Plan) -> Tensor:
    """``-P`` ``[Hv, NC + 1]`` fp64, non-decreasing per head: minus the log decay of all
    chunks before each chunk boundary (chunk totals from the chunk-local cumsum ``[...,
    T, Hv]``; gates above 0 count as 0)."""
    Hv = g_cumsum.shape[-1]
    decay = g_cumsum.reshape(-1, Hv).index_select(0, plan.chunk_last).t()  # [Hv,NC]
    return F.pad(torch.cumsum(decay.clamp(max=0.0), 1, dtype=torch.float64).neg_(), (1, 0))


def warmup_ends(g_cumsum: Tensor, plan: _Plan, bound: float) -> tuple[Tensor, Tensor]:
    """Where each (segment, value head) of the bounded split's backward starts its
    reverse sweep: the mirror of :func:`warmup_starts`. dS at a segment's end collects
    what comes after it through the transposed transitions, whose norm is at most the
    decay in between, so the sweep starts at the first chunk boundary e at or after the
    segment's end with ``sum of the chunk decays over [end, e) <= log(bound)`` (the
    first e with -P[e] >= -P[end] - log(bound)), or at its sequence's end, where the
    incoming state gradient dht enters.

    Returns ``(walk_end, dht_from)``, ``[Nseg, Hv]`` int32 on the device: the token
    where each reverse walk starts (exclusive end), and the sequence whose dht it starts
    from (-1: zero, the walk ends before its sequence's end). No host sync.
    """
    rising = _decay_before(g_cumsum, plan)                       # [Hv,NC+1]
    target = rising.index_select(1, plan.seg_chunk_end).sub_(math.log(bound))
    e = torch.searchsorted(rising, target)                       # first >= target
    e = torch.minimum(e, plan.seq_chunk_end)                     # in its sequence
    walk_end = e.new_empty(e.shape[::-1], dtype=torch.int32)    # [Nseg,Hv]
    tokens = torch.add(plan.walk_off, e, alpha=CHUNK).add_(CHUNK)   # seq start + C e'
    walk_end.t().copy_(torch.minimum(tokens, plan.seq_eos))
    dht_from = torch.empty_like(walk_end)
    dht_from.t().copy_(torch.where(e == plan.seq_chunk_end, plan.seg_n, -1))
    return walk_end, dht_from


def warmup_starts(g_cumsum: Tensor, plan: _Plan, bound: float) -> tuple[Tensor, Tensor]:
    """Where each (segment, value head) of the bounded split starts its recurrence.

    ``g_cumsum``: the chunk-local cumsum of the log gate, ``[..., T, Hv]`` fp32 (its
    value at a chunk's last token is the chunk's total log decay). For the segment
    starting at chunk b, the walk starts at the latest chunk c <= b of its sequence with
    ``sum of the chunk decays over [c, b) <= log(bound)`` (P non-increasing, P[c] = the
    decay before chunk c: the largest c with -P[c] <= -P[b] + log(bound), one
    ``searchsorted`` per head), or at its sequence's first chunk when none decays that
    far. A sequence's first segment starts at its own start.

    Returns ``(walk, h0_from)``, ``[Nseg, Hv]`` int32 on the device: the first token of
    each walk, and the sequence whose initial state it starts from (-1: a zero state, the
    walk begins after its sequence's start). Device work only (no host sync). Gates
    must be <= 0 (log decays, as everywhere); one above 0 counts as 0 (the bound then
    does not hold for the walks over it).
    """
    # the reference rule (the torch backend; sm90 searches it in its kernel instead)
    rising = _decay_before(g_cumsum, plan)                       # [Hv,NC+1]
    target = rising.index_select(1, plan.seg_chunk).add_(math.log(bound))  # [Hv,Nseg]
    c1 = torch.searchsorted(rising, target, right=True)         # c + 1 (count <= target)
    c1 = torch.maximum(c1, plan.seq_chunk1)                      # in its sequence
    walk = c1.new_empty(c1.shape[::-1], dtype=torch.int32)      # [Nseg,Hv]
    walk.t().copy_(torch.add(plan.walk_off, c1, alpha=CHUNK))   # bos + C (c - first)
    h0_from = torch.empty_like(walk)
    h0_from.t().copy_(torch.where(c1 == plan.seq_chunk1, plan.seg_n, -1))
    return walk, h0_from


@dataclass(frozen=True)
class _WalkRule:
    """A walk rule of the bounded split: one plan and bound. Called with g_cumsum, a
    rule computes its walks on the device (the reference, and what backends without an
    in-kernel search use); a kernel can instead search them itself from
    ``kernel_args``: ``(seq_token, seq_index, log_bound)``, each segment's sequence's
    boundary token and index (``[Nseg]`` int32) and the bound's natural log."""
    plan: _Plan
    bound: float

    @property
    def seq_index(self) -> Tensor:
        return self.plan.seg_seq

    @property
    def log_bound(self) -> float:
        return math.log(self.bound)


class WalkStarts(_WalkRule):
    """The ``starts`` of ``Kernels.fwd_warmup`` / ``bwd_warmup``: where each (segment,
    head) starts its recurrence (:func:`warmup_starts`, about a dozen small launches);
    its kernel arguments are ``seq_start`` (each segment's sequence's first token),
    ``seq_index`` and ``log_bound``."""

    def __call__(self, g_cumsum: Tensor) -> tuple[Tensor, Tensor]:
        return warmup_starts(g_cumsum, self.plan, self.bound)

    @property
    def seq_start(self) -> Tensor:
        return self.plan.seg_seq_start

    @property
    def kernel_args(self) -> tuple[Tensor, Tensor, float]:
        return self.seq_start, self.seq_index, self.log_bound


class WalkEnds(_WalkRule):
    """The ``ends`` of ``Kernels.bwd_warmup``, the mirror of :class:`WalkStarts`: where
    each (segment, head)'s reverse sweep starts (:func:`warmup_ends`, about twenty small
    launches); its kernel arguments are ``seq_end`` (each segment's sequence's end
    token), ``seq_index`` and ``log_bound``."""

    def __call__(self, g_cumsum: Tensor) -> tuple[Tensor, Tensor]:
        return warmup_ends(g_cumsum, self.plan, self.bound)

    @property
    def seq_end(self) -> Tensor:
        return self.plan.seg_seq_end

    @property
    def kernel_args(self) -> tuple[Tensor, Tensor, float]:
        return self.seq_end, self.seq_index, self.log_bound


def warmup_fwd(kernels, q, k, v, g, beta, *, scale: float, initial_state: Tensor | None,
               plan: _Plan | _DevicePlan, output_final_state: bool, shortcut_bound: float,
               keep_states: bool = False):
    """``Kernels.fwd`` contract (without h) by the bounded split, one pass of the
    backend's ``fwd_warmup`` over all segments (module docstring) of ``plan`` (the
    host's, :func:`_plan_for`, or a captured varlen batch's, :func:`_device_plan`).
    Arguments as :func:`segmented_fwd`; ``shortcut_bound`` in (0, 1). Returns
    ``(g_cumsum, A, o, states, final_state)``: ``states`` the chunk states the backend
    kept for ``bwd_warmup`` with ``keep_states`` (``Kernels.keeps_states``), else None."""
    keep = {"keep_states": True} if keep_states and keeps_states(kernels) else {}
    g_cumsum, A, o, final_seg, *kept = kernels.fwd_warmup(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=plan.cu,
        cu_seqlens_cpu=plan.cu_cpu, starts=WalkStarts(plan, shortcut_bound), **keep)
    final_state = None
    if output_final_state:                             # the last segment's, per sequence
        final_state = _rows(final_seg, plan.last_seg, plan.last_run, plan.N)  # [N,Hv,K,V]
        if plan.any_empty:                             # no segment: h0 (or zeros) as is
            empty = (plan.ends == 0)[:, None, None, None]
            fill = (final_state.new_zeros(()) if initial_state is None
                    else initial_state.to(final_state.dtype))
            final_state = torch.where(empty, fill, final_state)
    return g_cumsum, A, o, (kept[0] if kept else None), final_state


def uses_warmup(kernels, shortcut_bound: float) -> bool:
    """Whether a split on ``kernels`` with this bound is the bounded one (the backend
    has ``fwd_warmup`` and the bound is above 0), else the exact one."""
    return shortcut_bound > 0 and getattr(kernels, "fwd_warmup", None) is not None


def warmup_bwd(kernels, q, k, v, g_cumsum, beta, A, do, *, dht, scale, initial_state,
               cu_seqlens, cu_seqlens_cpu, segment_len: int, shortcut_bound: float,
               states: Tensor | None = None):
    """``Kernels.bwd`` contract for a forward that ran the bounded split, on a backend
    with ``bwd_warmup``: the chunk states by the warm-up forward (or ``states``, those
    the forward kept: :func:`warmup_fwd`), dS by reverse walks that start a few chunks
    after each segment (:func:`warmup_ends`), the per-chunk gradients as usual. Dense
    ``[B, T]`` inputs run as B packed sequences; the dropped terms obey the forward's
    bound. Returns ``(dq, dk, dv, dbeta, dg, dh0)``."""
    B, T = q.shape[:2]
    bounds = host_bounds(B, T, cu_seqlens, cu_seqlens_cpu)
    kept = {} if states is None else {"states": states}
    if bounds[-1] == bounds[0]:                                          # no tokens
        return kernels.bwd(q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale,
                           initial_state=initial_state, cu_seqlens=cu_seqlens,
                           cu_seqlens_cpu=cu_seqlens_cpu)
    plan = _plan_for(bounds, segment_len, q.device)
    *grads, dh0_seg = kernels.bwd_warmup(           # [B, T] tensors as is (no views)
        q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale, initial_state=initial_state,
        cu_seqlens=plan.cu, cu_seqlens_cpu=plan.cu_cpu, starts=WalkStarts(plan, shortcut_bound),
        ends=WalkEnds(plan, shortcut_bound), **kept)
    dh0 = None
    if initial_state is not None:                    # each sequence's first segment
        dh0 = _rows(dh0_seg, plan.first_seg, plan.first_run, plan.N)    # [N,Hv,K,V]
        if plan.any_empty:                           # no tokens: dh0 = dht (or 0)
            empty = (plan.ends == 0)[:, None, None, None]
            dh0 = torch.where(empty, dh0.new_zeros(()) if dht is None else dht, dh0)
    return (*grads, dh0)


def fwd_with_segments(kernels, q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
                      cu_seqlens_cpu, output_final_state, output_h, segment_len: int,
                      shortcut_bound: float = 0.0, keep_states: bool = False):
    """``kernels.fwd`` (same arguments and returns) made segment-parallel; dense
    ``[B, T]`` inputs are run as B packed sequences: the bounded split
    (:func:`warmup_fwd`) when ``shortcut_bound`` > 0, the backend has ``fwd_warmup`` and
    no h is asked for, else the exact one (:func:`segmented_fwd`). ``keep_states``
    (``Kernels.keeps_states``): the bounded split returns in h's place the states its
    backend keeps for ``bwd_warmup`` (the exact split keeps none). Reads ``cu_seqlens``
    on the host (``cu_seqlens_cpu`` avoids the sync). The split is planned on the host
    from the lengths of the call, except inside a CUDA-graph capture of a varlen batch
    (a replay may bring other lengths), where the bounded split is planned on the
    device (:func:`_device_plan`) on a backend that searches its walks in the kernel
    (``Kernels.searches_walks``). A capture of anything else (the exact split, or a
    varlen batch on another backend): ValueError."""
    B, T = q.shape[:2]
    capturing = is_capturing(q.device)
    warm = uses_warmup(kernels, shortcut_bound) and not output_h
    if capturing and not (warm and (cu_seqlens is None or searches_walks(kernels))):
        raise ValueError(f"segment_len: expected None inside CUDA-graph capture, except "
                         f"for the bounded split (segment_shortcut_bound > 0) of a dense "
                         f"input, or of a varlen one on a backend that searches its walks "
                         f"in the kernel (sm90): the split is planned from the call's "
                         f"lengths, got {segment_len}")
    if capturing and cu_seqlens is not None:         # live lengths: planned per replay
        plan = _device_plan(cu_seqlens, B * T, segment_len)
    else:
        bounds = host_bounds(B, T, cu_seqlens, cu_seqlens_cpu)
        bounded = warm and bounds[-1] > bounds[0]
        if capturing and not bounded:
            raise ValueError(f"segment_len: a dense input without tokens is not split "
                             f"inside CUDA-graph capture, got {segment_len}")
        plan = _plan_for(bounds, segment_len, q.device) if bounded else None
    if plan is not None:       # the bounded split, one pass, on the [B, T] tensors as is
        return warmup_fwd(kernels, q, k, v, g, beta, scale=scale,
                          initial_state=initial_state, plan=plan,
                          output_final_state=output_final_state,
                          shortcut_bound=shortcut_bound, keep_states=keep_states)
    packed = [_with_batch(x, 1, B * T) for x in (q, k, v, g, beta)]
    g_cumsum, A, o, h, final_state = segmented_fwd(
        kernels, *packed, scale=scale, initial_state=initial_state, bounds=bounds,
        output_final_state=output_final_state, output_h=output_h, segment_len=segment_len)
    return (_with_batch(g_cumsum, B, T), _with_batch(A, B, T), _with_batch(o, B, T),
            None if h is None else h.reshape(B, -1, *h.shape[2:]), final_state)
