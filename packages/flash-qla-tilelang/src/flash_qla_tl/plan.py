"""Every per-call choice of the Hopper backend, each returned with its reason.

Fixed on this backend (no choice): the prepare kernel (``chunk_cumsum_inverse``), the
forward kernel (``chunk_state_output``, one CTA per (sequence, value head), the whole
state in registers), the chunk states h and dS1 in q's dtype between the kernels, and dq,
dk per value head in q's dtype, summed over each GVA group by ``group_sum``. Chosen per
call, here:

- :func:`keep_states`: whether the training forward stores h for its backward, or the
  backward recomputes it;
- :func:`segment_len`: the automatic segment split of long sequences at few heads,
  exact (three passes and a scan) or bounded (one pass with warm-up walks), from the
  cost model below;
- :func:`fused_backward`: the fused reverse kernel (``chunk_grads_fused``) or the sweep
  and the per-chunk gradient kernel (``chunk_state_grad`` + ``chunk_input_grads``).

Each returns a :class:`Choice` (the value and why). The choices are cached per argument
values and logged at debug level when first made (``logging.getLogger(
"flash_qla_tl.plan")``), so a training loop logs each distinct shape once. Variants
that lost a measurement (the per-call tiling of a split-state forward, the fp32 prepare,
the tiled reverse sweep, fp32 states between the kernels) are kept under the git tag
``retired-sm90-variants``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

from flash_qla.validation import is_capturing

from .kernels.traits import CHUNK
from .layout import ChunkLayout, chunks_known, walk_chunks

log = logging.getLogger(__name__)

# ---- cost model (H200 fits; docs/perf-notes.md has the runs) ------------------------

#: One chunk step of a ``chunk_state_output`` CTA, us (3.72-3.97 on 16/16 4x8192, 16/32
#: 8x4096, 2/8 1x2048; ``benchmark/tune_chunk_fwd.py``'s "us/chunk"). A grid of n CTAs
#: costs ceil(n / SMs) x chunks x this.
FWD_CHUNK_US = 3.85

#: The prepare kernel per (chunk, value head), us over the whole GPU (0.0153-0.0167 on
#: 16/32 8x4096, 16/16 4x8192, 2/8 1x32768).
PREPARE_US_PER_CHUNK_HEAD = 0.016

#: The exact segment split: the lengths tried; one step of the scan over segment
#: positions and the split's fixed work (host planning, index tensors, launches), fitted
#: by least squares on 12 split rows (``benchmark/fit_segment_cost.py --exact``;
#: residuals up to +-0.76 ms: the split path is host-bound). Segments of 1024 and 2048
#: lost to 4096 on every shape measured and to no split on most. The fixed cost was
#: fitted before plans were cached per lengths, which later measured the split 25-46%
#: faster: an overestimate that keeps the planner conservative (docs/perf-notes.md v5).
SEGMENT_LENS = (4096, 8192)
SEGMENT_SCAN_STEP_US = 45.0
SEGMENT_FIXED_US = 730.0
#: The predicted gain a split must bring over the unsplit forward.
SEGMENT_MIN_GAIN = 0.05

#: The bounded segment split (one pass of ``chunk_state_output`` with warm-up walks;
#: ``flash_qla.segments.warmup_fwd``): the planner takes the shortest segment, a whole
#: number of chunks and at least ``WARMUP_MIN_SEGMENT`` tokens, whose segments x Hv CTAs
#: fit one wave (one CTA per SM), so its worst case, gates that never decay to the bound
#: (every walk back to its sequence start), costs about the unsplit pass; and only when
#: its predicted time beats the unsplit forward's by ``SEGMENT_MIN_GAIN``: ``(segment
#: chunks + WARMUP_CHUNKS)`` chunk steps + the prepare, but at least ``WARMUP_HOST_US``,
#: the host time of an eager bounded-split call (measured GPU-bound at 0.24-0.55 ms on
#: five 1x32768 rows against graph replays of 0.21-0.58: the host floor is at most ~250
#: us). The shortest such segment divides a sequence evenly: one 24k-token sequence at 64
#: heads takes two segments of 12288 tokens (192 chunks per CTA), where lengths restricted
#: to powers of two took 16384 + 8192 (256 chunks on the critical path).
WARMUP_MIN_SEGMENT = 512
#: A typical walk at the benchmark's 'model' gates (Qwen3-Next init: the slowest heads
#: need ~4000 tokens to decay to 2^-9, most far fewer), in chunks.
WARMUP_CHUNKS = 16
WARMUP_HOST_US = 250.0

#: The backward's choice (``benchmark/tune_chunk_bwd.py``): one chunk step of the fused
#: kernel's CTA (11.25-12.3 at 128 CTAs); one chunk step of ``chunk_state_grad`` (2/8
#: 1x32768: the two kernels' 1.92 ms less the per-chunk kernel's share); one
#: ``chunk_input_grads`` CTA (one per chunk and value head, one per SM: 1045 us / 62
#: waves at 4/16 1x32768).
BWD_FUSED_STEP_US = 11.8
BWD_SWEEP_STEP_US = 2.7
BWD_INTRA_CTA_US = 16.9


class Choice(NamedTuple):
    """A planned choice and the reason for it (one line)."""
    value: Any
    reason: str


def _chosen(what: str, choice: Choice) -> Choice:
    log.debug("%s: %s (%s)", what, choice.value, choice.reason)
    return choice


# ---- whether the forward keeps h for the backward -------------------------------------

def keep_states(layout: ChunkLayout, cu_seqlens_cpu, bound_ok: bool = False) -> Choice:
    """Whether a training forward stores its chunk states h (in q's dtype) for the
    backward, which then reads them instead of recomputing them: where h's size is
    known without a host sync: the chunk count (dense inputs, or host offsets), or,
    with ``bound_ok`` inside a CUDA-graph capture, the layout's bound
    (:func:`layout.total_chunks`: rows past a replay's real count are neither written
    nor read). ``bound_ok``: the backward reads h in this layout's chunk numbering (the
    unsplit forward; not a varlen split captured on the device, whose backward runs
    unsplit on the sequences' chunks). Elsewhere the backward recomputes h."""
    return _keep_states(layout.num_chunks is not None, chunks_known(layout, cu_seqlens_cpu),
                        bound_ok and is_capturing(layout.cu_seqlens.device))


@functools.lru_cache(maxsize=8)
def _keep_states(dense: bool, known: bool, capturing: bool) -> Choice:
    if known:
        why = "dense input" if dense else "host offsets (cu_seqlens_cpu)"
        return _chosen("keep h for the backward",
                       Choice(True, f"{why}: the chunk count is known without a sync"))
    if capturing:
        return _chosen("keep h for the backward",
                       Choice(True, "CUDA-graph capture: h sized by the layout's bound"))
    return _chosen("keep h for the backward",
                   Choice(False, "device-only cu_seqlens: h's size would need a host sync; "
                                 "the backward recomputes h"))


# ---- the forward's cost ---------------------------------------------------------------

def waves(num_seqs: int, Hv: int, sm_count: int) -> int:
    """Rounds of one CTA per SM for one CTA per (sequence, value head)."""
    return -(-num_seqs * Hv // sm_count)


def chunks_of(lens) -> list[int]:
    """Chunks of each non-empty sequence of ``lens`` tokens."""
    return [-(-n // CHUNK) for n in lens if n > 0]


def fwd_kernel_us(chunks: list[int], Hv: int, sm_count: int) -> float:
    """Predicted ``chunk_state_output`` time, us, of sequences of ``chunks`` chunks (all
    > 0): the longest sequence's chunks, in waves of one CTA per SM."""
    return max(chunks) * waves(len(chunks), Hv, sm_count) * FWD_CHUNK_US


def prepare_us(chunks: list[int], Hv: int) -> float:
    """Predicted prepare time, us: ``PREPARE_US_PER_CHUNK_HEAD`` per (chunk, head)."""
    return sum(chunks) * Hv * PREPARE_US_PER_CHUNK_HEAD


def predicted_fwd_us(lens: list[int], Hv: int, sm_count: int) -> float:
    """Predicted unsplit forward time (prepare + recurrence), us, of packed sequences of
    ``lens`` tokens."""
    chunks = chunks_of(lens)
    if not chunks:
        return 0.0
    return fwd_kernel_us(chunks, Hv, sm_count) + prepare_us(chunks, Hv)


def bounded_gpu_us(lens: list[int], Hv: int, seg: int) -> float:
    """Predicted GPU time, us, of the bounded split at segment length ``seg``: one pass
    of ``seg`` chunks + ``WARMUP_CHUNKS`` warm-up per CTA (one wave), and the prepare."""
    return ((seg // CHUNK + WARMUP_CHUNKS) * FWD_CHUNK_US + prepare_us(chunks_of(lens), Hv))


def exact_passes_us(lens: list[int], Hv: int, sm_count: int, seg: int) -> float:
    """Predicted time, us, of the exact split's three passes and one prepare over the
    segments of length ``seg`` (the planner adds the scan and the fixed cost)."""
    pieces = [-(-min(seg, n - s) // CHUNK) for n in lens for s in range(0, n, seg)]
    return 3 * fwd_kernel_us(pieces, Hv, sm_count) + prepare_us(pieces, Hv)


# ---- the segment split ----------------------------------------------------------------

def segment_len(bounds, Hv: int, sm_count: int, bounded: bool = False,
                dominant: bool = True) -> Choice:
    """The automatic segment split of a call (``Kernels.plan_segment_len``): the segment
    length, or None (no split). ``bounds``: host sequence offsets ``[N + 1]``;
    ``bounded``: for the one-pass bounded split (:func:`plan_bounded`), else for the
    exact one (:func:`plan_exact`); ``dominant`` False: a batch whose (sequence, head)
    pairs fill the GPU is not split (:func:`plan_bounded`).
    Cached per argument values: a training loop or a server repeats the same lengths,
    and an eager call's host time is the bounded split's floor (the planner costs ~50 us
    of Python, the cache key ~1)."""
    return _segment_len(tuple(bounds), Hv, sm_count, bounded, dominant)


@functools.lru_cache(maxsize=256)
def _segment_len(bounds: tuple[int, ...], Hv: int, sm_count: int, bounded: bool,
                 dominant: bool) -> Choice:
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    choice = (plan_bounded(lens, Hv, sm_count, dominant=dominant) if bounded
              else plan_exact(lens, Hv, sm_count))
    return _chosen("bounded segment split" if bounded else "exact segment split", choice)


def plan_bounded(lens: list[int], Hv: int, sm_count: int, host_us: float = WARMUP_HOST_US,
                 dominant: bool = True) -> Choice:
    """The bounded split's segment length in tokens, or None.

    Sequences x Hv below ``sm_count`` (one wave with room): the shortest whole number of
    chunks (at least ``WARMUP_MIN_SEGMENT`` tokens) whose segments x Hv CTAs still fit
    one wave, if its predicted time (at least ``host_us``) beats the unsplit forward's by
    ``SEGMENT_MIN_GAIN``. The CTA count falls as the segment grows, so the shortest one
    is found by bisection over the chunk count.

    More CTAs than SMs (:func:`plan_dominant`): only where one sequence is so much
    longer than the rest that its chain, not the GPU's total work, bounds the kernel,
    and only with ``dominant`` (the core clears it for a capture's guess of one long
    sequence, which would split every replay's batch of short ones, and for a captured
    varlen training step, whose backward runs unsplit and recomputes h)."""
    longest = max(lens, default=0)
    if longest <= WARMUP_MIN_SEGMENT:
        return Choice(None, f"longest sequence {longest} <= {WARMUP_MIN_SEGMENT} "
                            "tokens: nothing to split")
    if len(lens) * Hv >= sm_count:
        if not dominant:
            return Choice(None, f"{len(lens)} sequences x {Hv} heads fill the {sm_count} "
                                "SMs (no split of a full grid asked for)")
        return plan_dominant(lens, Hv, sm_count)
    chunks = chunks_of(lens)

    def ctas(seg: int) -> int:                  # seg in chunks
        return sum(-(-n // seg) for n in chunks) * Hv

    longest_chunks = max(chunks)
    lo, hi = WARMUP_MIN_SEGMENT // CHUNK, longest_chunks  # ctas(hi) = len * Hv < SMs
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ctas(mid) > sm_count else (lo, mid)
    if lo >= longest_chunks:
        return Choice(None, f"no segment shorter than {longest} tokens fits one wave")
    seg = lo * CHUNK
    unsplit = predicted_fwd_us(lens, Hv, sm_count)
    us = max(bounded_gpu_us(lens, Hv, seg), host_us)      # an eager call's host floor
    if us < unsplit * (1 - SEGMENT_MIN_GAIN):
        return Choice(seg, f"{ctas(lo)} CTAs fit one wave: predicted {us:.0f} us against "
                           f"{unsplit:.0f} unsplit")
    return Choice(None, f"segments of {seg} predicted {us:.0f} us against {unsplit:.0f} "
                        f"unsplit: less than {SEGMENT_MIN_GAIN:.0%} gain")


def plan_dominant(lens: list[int], Hv: int, sm_count: int) -> Choice:
    """The bounded split of a batch whose (sequence, head) CTAs outnumber the SMs, or
    None. Counted in chunk steps of one CTA: the work per SM if perfectly spread is
    ``spread = chunks x Hv / SMs``; unsplit, the kernel takes at least
    ``max(longest, spread)``. Split into segments of ``s = max(spread, WARMUP_MIN_SEGMENT
    tokens)`` chunks (sequences no longer than that stay whole), the GPU's block
    scheduler (CTAs in grid order, each to the first free SM) finishes within
    ``spread' + s + WARMUP_CHUNKS`` (Graham's bound for list scheduling, ``spread'``
    counting the warm-ups). The split is taken when that bound beats the unsplit floor
    by ``SEGMENT_MIN_GAIN``: a sequence about twice as long as the spread or more, as one
    long rollout among many short ones in an RL batch. The bound, not an estimate,
    keeps batches of comparable lengths whole (six sequences of 1.5k-5k tokens at 32
    heads: floor 79 steps, bound 147)."""
    chunks = chunks_of(lens)
    total, longest = sum(chunks), max(chunks)
    spread = total * Hv / sm_count
    seg = max(-(-total * Hv // sm_count), WARMUP_MIN_SEGMENT // CHUNK)   # >= spread
    if longest <= seg:
        return Choice(None, f"{len(lens)} sequences x {Hv} heads fill the {sm_count} SMs "
                            f"and none is longer than the spread ({spread:.0f} chunks)")
    # past here longest > seg >= spread: the unsplit floor is the longest chain
    extra = sum(-(-n // seg) - 1 for n in chunks)         # segments that warm up
    bound = (total + extra * WARMUP_CHUNKS) * Hv / sm_count + seg + WARMUP_CHUNKS
    if bound < longest * (1 - SEGMENT_MIN_GAIN):
        return Choice(seg * CHUNK, f"longest sequence {longest} chunks against a spread "
                                   f"of {spread:.0f}: split bound {bound:.0f} steps")
    return Choice(None, f"longest sequence {longest} chunks, spread {spread:.0f}: split "
                        f"bound {bound:.0f} steps, not {SEGMENT_MIN_GAIN:.0%} under the longest")


def plan_exact(lens: list[int], Hv: int, sm_count: int) -> Choice:
    """The exact split's segment length (``SEGMENT_LENS``), or None: the length whose
    predicted time beats the unsplit forward's by at least ``SEGMENT_MIN_GAIN``. The
    split costs one prepare and three passes over all segments (``flash_qla.segments``
    with ``fwd_prepared``: local states, transitions, output), one scan step per segment
    position of the longest sequence (``SEGMENT_SCAN_STEP_US``) and
    ``SEGMENT_FIXED_US``."""
    longest = max(lens, default=0)
    if longest <= min(SEGMENT_LENS):                  # O(N) host work per call, no more
        return Choice(None, f"longest sequence {longest} <= {min(SEGMENT_LENS)} tokens: "
                            "nothing to split")
    unsplit = predicted_fwd_us(lens, Hv, sm_count)
    best, best_us = None, unsplit * (1 - SEGMENT_MIN_GAIN)
    for seg in SEGMENT_LENS:
        steps = -(-longest // seg)                    # scan positions
        if steps < 2:
            continue                                  # no sequence is split at this length
        us = (exact_passes_us(lens, Hv, sm_count, seg) + steps * SEGMENT_SCAN_STEP_US
              + SEGMENT_FIXED_US)
        if us < best_us:
            best, best_us = seg, us
    if best is None:
        return Choice(None, f"no split predicted {SEGMENT_MIN_GAIN:.0%} faster than "
                            f"{unsplit:.0f} us unsplit")
    return Choice(best, f"predicted {best_us:.0f} us against {unsplit:.0f} unsplit")


# ---- the backward's kernels -----------------------------------------------------------

def fused_pays(longest: int, total: int, Hv: int, sm_count: int) -> bool:
    """Whether ``chunk_grads_fused`` is predicted faster than ``chunk_state_grad`` +
    ``chunk_input_grads`` for sequences (or segments) whose longest has ``longest``
    chunks, ``total`` in all. Both the fused kernel and the sweep walk each (sequence,
    value head) in one CTA, so each takes its chunk step times the larger of the longest
    walk and the chunks per SM; the per-chunk kernel adds one CTA per (chunk, value
    head), one per SM at a time::

        fused_step * spread  <  sweep_step * spread + intra_cta * total * Hv / SMs,
        spread = max(longest, total * Hv / SMs)

    (``BWD_FUSED_STEP_US``, ``BWD_SWEEP_STEP_US``, ``BWD_INTRA_CTA_US``). On the H200,
    with walks of equal length, the fused kernel wins from about 70 CTAs (the bounded
    split's segments at 16 heads, 8 x 4096 at 16 heads); one sequence at 16 heads, or
    one long sequence among many short ones, runs the two kernels."""
    if total * Hv == 0:
        return False
    per_sm = total * Hv / sm_count
    spread = max(longest, per_sm)
    return (BWD_FUSED_STEP_US * spread
            < BWD_SWEEP_STEP_US * spread + BWD_INTRA_CTA_US * per_sm)


def fused_backward(layout: ChunkLayout, cu_seqlens_cpu, Hv: int, sm_count: int,
                   hint=None) -> Choice:
    """Whether the backward of a call (or of a split's segments: ``layout`` holds them)
    runs the fused reverse kernel (:func:`fused_pays` on the call's walks). Without host
    offsets (inside a CUDA-graph capture): from ``hint``, host offsets an eager call
    read of the same unmodified tensor (``flash_qla.offsets.kept_offsets``: a heuristic,
    both choices are exact at any replay's lengths), else bounded by the token count, as
    if one sequence held every token, which keeps the two kernels."""
    return _fused_backward(*walk_chunks(layout, cu_seqlens_cpu if cu_seqlens_cpu is not None
                                        else hint), Hv, sm_count)


@functools.lru_cache(maxsize=256)
def _fused_backward(longest: int, total: int, Hv: int, sm_count: int) -> Choice:
    fused = fused_pays(longest, total, Hv, sm_count)
    walks = f"walks of <= {longest} chunks, {total} in all, {Hv} heads, {sm_count} SMs"
    kernels = "chunk_grads_fused" if fused else "chunk_state_grad + chunk_input_grads"
    return _chosen("fused backward", Choice(fused, f"{kernels}: {walks}"))
