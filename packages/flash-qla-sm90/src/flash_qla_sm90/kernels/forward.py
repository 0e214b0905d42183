"""Forward orchestrator of the Hopper backend: prepare (gate cumsum + inverse), then the
fused chunk-recurrent kernel. Shapes follow ``flash_qla.backend.Kernels.fwd``."""

from __future__ import annotations

import functools

import torch

from flash_qla.validation import is_capturing

from . import traits
from .chunk_fwd import chunk_fwd_kernel
from .chunk_fwd_t import chunk_fwd_t_kernel
from .chunk_fwd_ws import chunk_fwd_ws_kernel
from .chunk_layout import ChunkLayout, dense_layout, static_layout, varlen_layout
from .chunk_prepare import PREPARE_KERNELS
from .launch import launcher
from .traits import CHUNK

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

#: The transposed-state forwards by ``_fused(tiling=...)`` name (tuning): one CTA per
#: (sequence, value head); ``transposed_kernel`` says which one the default path runs.
TRANSPOSED_KERNELS = {"t": chunk_fwd_t_kernel, "ws": chunk_fwd_ws_kernel}


def transposed_kernel() -> str:
    """Name in ``TRANSPOSED_KERNELS`` of the transposed forward ``traits`` selects."""
    return "ws" if traits.FWD_AUX_WARPGROUP else "t"


def prepare_kernel_name() -> str:
    """Name in ``PREPARE_KERNELS`` of the prepare kernel ``traits.PREPARE_BLOCKED`` selects."""
    return "prepare-blocked" if traits.PREPARE_BLOCKED else "prepare"


def prepare_kernel():
    """Builder of the selected prepare kernel (both take the same arguments)."""
    return PREPARE_KERNELS[prepare_kernel_name()]


def layout_for(q: torch.Tensor, cu_seqlens: torch.Tensor | None,
               static: bool = False) -> ChunkLayout:
    """The call's chunk layout; cached in eager mode, rebuilt inside a CUDA-graph capture
    (the graph then recomputes it from the live ``cu_seqlens`` at every replay, and no
    cache entry points into the graph's memory). ``static``: ``cu_seqlens`` never
    changes (a split's segment offsets): one layout built outside any capture serves
    every call and capture (``chunk_layout.static_layout``)."""
    B, T = q.shape[:2]
    if static and cu_seqlens is not None:
        return static_layout(cu_seqlens, B * T, is_capturing(q.device))
    dense, varlen = dense_layout, varlen_layout
    if is_capturing(q.device):
        dense, varlen = dense.__wrapped__, varlen.__wrapped__        # uncached builders
    return dense(B, T, q.device) if cu_seqlens is None else varlen(cu_seqlens, B * T)


def static_flags(*flags: bool) -> tuple[bool, ...]:
    """Trailing boolean arguments of a kernel builder without its trailing False ones,
    so a call with the defaults hits the same cache entry (the shipped cache's keys) as
    a call that omits them."""
    flags = tuple(flags)
    while flags and not flags[-1]:
        flags = flags[:-1]
    return flags


def _packed(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T, ...] -> contiguous [B*T, ...], optionally cast."""
    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return (x if dtype is None or x.dtype == dtype else x.to(dtype)).contiguous()


def _zero_padding_rows(cu_seqlens, cu_seqlens_cpu, num_tokens: int) -> bool:
    """Whether outputs need zero-init: tokens after cu_seqlens[-1] belong to no sequence."""
    if cu_seqlens is None:
        return False
    if cu_seqlens_cpu is not None:
        return int(cu_seqlens_cpu[-1]) < num_tokens
    return True          # unknown without a host sync: zero-init


def chunks_known(layout: ChunkLayout, cu_seqlens_cpu) -> bool:
    """Whether :func:`total_chunks` answers without a host sync (dense, or host offsets)."""
    return layout.num_chunks is not None or cu_seqlens_cpu is not None


def host_chunks(cu_seqlens_cpu) -> list[int]:
    """Chunks of each sequence, from host offsets ``[N + 1]`` (in Python: a few host
    tensor ops cost more)."""
    cu = cu_seqlens_cpu.tolist()
    return [-(-(b - a) // CHUNK) for a, b in zip(cu, cu[1:])]


def total_chunks(layout: ChunkLayout, cu_seqlens_cpu) -> int:
    """Rows of a per-chunk buffer (h, dS1): the chunk count, exact for dense inputs and
    host offsets; inside a CUDA-graph capture without them the layout's upper bound
    (the kernels index rows by ``chunk_offsets``, rows past the real count stay
    unwritten and unread); else read from the device (one sync)."""
    if layout.num_chunks is not None:
        return layout.num_chunks
    if cu_seqlens_cpu is not None:
        return sum(host_chunks(cu_seqlens_cpu))
    if is_capturing(layout.cu_seqlens.device):
        return layout.num_chunks_max
    return int(layout.chunk_offsets[-1].item())   # host sync: h needs its size


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_tiling(num_seqs: int, Hv: int, V: int, sm_count: int,
                 narrow: bool | None = None, wide: bool | None = None) -> tuple:
    """``(block_v, threads)`` of ``chunk_fwd`` for ``num_seqs * Hv`` state tiles, or
    ``()`` for the ``traits`` defaults: the BLOCK_V among the enabled ones (64; 32 if
    ``narrow``, 128 if ``wide``) with the least ``ceil(CTAs / sm_count) *
    traits.FWD_CHUNK_US[BLOCK_V]`` (one CTA per SM; sequences assumed of equal length).
    Narrow wins while its doubled grid still fits one wave, wide once its halved grid
    saves a round. ``narrow`` / ``wide`` None follow ``traits.FWD_NARROW_TILING`` /
    ``FWD_WIDE_TILING``.

    >>> fused_tiling(1, 8, 128, 132, True, True), fused_tiling(1, 64, 128, 132, True, True)
    ((32, 256), ())
    >>> fused_tiling(8, 16, 128, 132, True, True), fused_tiling(8, 20, 128, 132, True, True)
    ((128, 256), ())
    """
    return _best_tiling(num_seqs, Hv, V, sm_count, narrow, wide)[0]


def _best_tiling(num_seqs: int, Hv: int, V: int, sm_count: int,
                 narrow: bool | None, wide: bool | None) -> tuple[tuple, float]:
    """The cheapest enabled ``chunk_fwd`` tiling and its predicted us per chunk."""
    options = _tiling_options(V, narrow, wide)
    costs = {bv: _tiling_cost(num_seqs, Hv, V, sm_count, bv) for bv in options}
    block_v = min(costs, key=costs.get)
    return options[block_v], costs[block_v]


def _tiling_options(V: int, narrow: bool | None, wide: bool | None) -> dict:
    """BLOCK_V -> chunk_fwd tiling arguments, for the enabled tilings."""
    narrow = traits.FWD_NARROW_TILING if narrow is None else narrow
    wide = traits.FWD_WIDE_TILING if wide is None else wide
    options = {traits.BLOCK_V: ()}
    if narrow:
        options[traits.BLOCK_V_NARROW] = traits.FWD_NARROW
    if wide and V >= traits.BLOCK_V_WIDE:
        options[traits.BLOCK_V_WIDE] = traits.FWD_WIDE
    return options


def waves(num_seqs: int, Hv: int, V: int, sm_count: int, block_v: int) -> int:
    """Rounds of one CTA per SM for a grid of ``num_seqs * Hv * V / block_v`` CTAs."""
    return -(-num_seqs * Hv * (V // block_v) // sm_count)


def _tiling_cost(num_seqs: int, Hv: int, V: int, sm_count: int, block_v: int) -> float:
    """Predicted us per chunk of the whole grid: ceil(CTAs / SMs) x us per CTA-chunk."""
    return waves(num_seqs, Hv, V, sm_count, block_v) * traits.FWD_CHUNK_US[block_v]


def fused_plan(num_seqs: int, Hv: int, K: int, V: int, sm_count: int,
               ) -> tuple[tuple | str, float]:
    """The fused kernel the cost model picks for ``num_seqs * Hv`` (sequence, head)
    pairs, and its predicted us per chunk of the whole grid: the transposed forward's
    name (:func:`transposed_kernel`; one CTA per pair) when ``traits.FWD_TRANSPOSED`` is
    on, K = V = 128 and it is cheaper than every enabled ``chunk_fwd`` tiling, else that
    cheapest tiling's arguments (:func:`fused_tiling`). Cached per arguments and
    ``traits.revision`` (every eager forward and backward asks: ~10 us of Python)."""
    return _fused_plan(num_seqs, Hv, K, V, sm_count, traits.revision)


@functools.lru_cache(maxsize=256)
def _fused_plan(num_seqs: int, Hv: int, K: int, V: int, sm_count: int,
                traits_revision: int) -> tuple[tuple | str, float]:
    """:func:`fused_plan`, uncached."""
    tiling, cost = _best_tiling(num_seqs, Hv, V, sm_count, None, None)
    if traits.FWD_TRANSPOSED and (K, V) == (128, 128):
        us = traits.FWD_CHUNK_US_TRANSPOSED[transposed_kernel()]
        mine = waves(num_seqs, Hv, V, sm_count, V) * us
        if mine < cost:
            return transposed_kernel(), mine
    return tiling, cost


def use_transposed(num_seqs: int, Hv: int, K: int, V: int, sm_count: int) -> bool:
    """Whether :func:`fused_plan` picks the transposed forward for the call."""
    return fused_plan(num_seqs, Hv, K, V, sm_count)[0] in TRANSPOSED_KERNELS


def _fused_us(chunks: list[int], Hv: int, K: int, V: int, sm_count: int) -> float:
    """Predicted fused-kernel time, us, of sequences of ``chunks`` chunks (all > 0)."""
    return max(chunks) * fused_plan(len(chunks), Hv, K, V, sm_count)[1]


def _prepare_us(chunks: list[int], Hv: int) -> float:
    """Predicted prepare time, us: ``traits.PREPARE_US_PER_CHUNK_HEAD`` per (chunk, head)."""
    return sum(chunks) * Hv * traits.PREPARE_US_PER_CHUNK_HEAD


def predicted_fwd_us(lens: list[int], Hv: int, K: int, V: int, sm_count: int) -> float:
    """Predicted forward time (prepare + fused kernel), microseconds, of packed sequences
    of ``lens`` tokens: :func:`fused_plan`'s cost at the longest sequence's chunk count,
    plus ``traits.PREPARE_US_PER_CHUNK_HEAD`` per (chunk, value head)."""
    chunks = [-(-n // CHUNK) for n in lens if n > 0]                 # per sequence
    if not chunks:
        return 0.0
    return _fused_us(chunks, Hv, K, V, sm_count) + _prepare_us(chunks, Hv)


def warmup_available(K: int, V: int) -> bool:
    """Whether the bounded split's kernel (``chunk_fwd_ws`` with ``warmup``) runs these
    head dims with the current traits."""
    return (K, V) == (128, 128) and traits.FWD_TRANSPOSED and transposed_kernel() == "ws"


def bounded_gpu_us(lens: list[int], Hv: int, seg: int) -> float:
    """Predicted GPU time, us, of the bounded split at segment length ``seg``: one ws
    pass of ``seg`` chunks + ``traits.WARMUP_CHUNKS`` warm-up per CTA (one wave), and
    the prepare."""
    chunks = [-(-n // CHUNK) for n in lens if n > 0]
    return ((seg // CHUNK + traits.WARMUP_CHUNKS) * traits.FWD_CHUNK_US_TRANSPOSED["ws"]
            + _prepare_us(chunks, Hv))


def exact_passes_us(lens: list[int], Hv: int, K: int, V: int, sm_count: int,
                    seg: int) -> float:
    """Predicted time, us, of the exact split's three fused passes and one prepare over
    the segments of length ``seg`` (the planner adds the scan and the fixed cost)."""
    pieces = [-(-min(seg, n - s) // CHUNK) for n in lens for s in range(0, n, seg)]
    return 3 * _fused_us(pieces, Hv, K, V, sm_count) + _prepare_us(pieces, Hv)


def _plan_bounded(lens: list[int], Hv: int, K: int, V: int, sm_count: int) -> int | None:
    """The bounded split's segment length (``traits.WARMUP_SEGMENT_LENS``), or None:
    the shortest whose segments x Hv CTAs fit one wave, if its predicted time (at least
    ``traits.WARMUP_HOST_US``) beats the unsplit forward's by
    ``traits.SEGMENT_MIN_GAIN``."""
    if not warmup_available(K, V):
        return None
    longest = max(lens, default=0)
    unsplit = predicted_fwd_us(lens, Hv, K, V, sm_count)
    for seg in traits.WARMUP_SEGMENT_LENS:
        if seg >= longest:
            return None                                   # splits nothing
        if sum(-(-n // seg) for n in lens if n > 0) * Hv > sm_count:
            continue                                      # more than one wave
        us = max(bounded_gpu_us(lens, Hv, seg),       # an eager call is host-bound below
                 traits.WARMUP_HOST_US)
        return seg if us < unsplit * (1 - traits.SEGMENT_MIN_GAIN) else None
    return None


def plan_segment_len(bounds: list[int], Hv: int, K: int, V: int, sm_count: int,
                     bounded: bool = False) -> int | None:
    """:func:`_plan_segment_len`, cached per (lengths, heads, dims, SMs, split kind and
    ``traits.revision``, so a plan is never reused after a trait is patched): a training
    loop or a server repeats the same lengths, and an eager call's host time is the
    bounded split's floor (the planner costs ~50 us of Python, the cache key ~1)."""
    return _plan_segment_len(tuple(bounds), Hv, K, V, sm_count, bounded, traits.revision)


@functools.lru_cache(maxsize=256)
def _plan_segment_len(bounds: tuple[int, ...], Hv: int, K: int, V: int, sm_count: int,
                      bounded: bool, traits_revision: int) -> int | None:
    """The automatic segment-parallelism choice (``auto_cp``), or None (no split; also
    whenever ``traits.SEGMENT_AUTO`` is off). ``bounds``: host sequence offsets
    ``[N + 1]``. ``bounded``: for the one-pass bounded split (:func:`_plan_bounded`).
    Else for the exact split: the length in ``traits.SEGMENT_LENS`` whose predicted
    time beats the unsplit forward's by at least ``traits.SEGMENT_MIN_GAIN``.

    The split costs one prepare and three fused passes over all segments
    (``flash_qla.segments`` with ``fwd_prepared``: local states, transitions, output),
    one scan step per segment position of the longest sequence
    (``traits.SEGMENT_SCAN_STEP_US``) and ``traits.SEGMENT_FIXED_US``.
    """
    if not traits.SEGMENT_AUTO:
        return None
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    longest = max(lens, default=0)
    if bounded:
        if longest <= min(traits.WARMUP_SEGMENT_LENS) or len(lens) * Hv >= sm_count:
            return None                               # nothing to split / grid full
        return _plan_bounded(lens, Hv, K, V, sm_count)
    if longest <= min(traits.SEGMENT_LENS):           # no length splits any sequence:
        return None                                   # O(N) host work per call, no more
    best = None
    best_us = predicted_fwd_us(lens, Hv, K, V, sm_count) * (1 - traits.SEGMENT_MIN_GAIN)
    for seg in traits.SEGMENT_LENS:
        steps = -(-longest // seg)                    # scan positions
        if steps < 2:
            continue                                  # no sequence is split at this length
        us = (exact_passes_us(lens, Hv, K, V, sm_count, seg)
              + steps * traits.SEGMENT_SCAN_STEP_US + traits.SEGMENT_FIXED_US)
        if us < best_us:
            best, best_us = seg, us
    return best


@functools.lru_cache(maxsize=8)
def _no_walk(device: torch.device) -> torch.Tensor:
    """``[1]`` int32: the ``seq_start`` / ``seq_index`` of a ws launch without warm-up,
    and the ``seq_end`` / ``seq_index`` of a dh sweep without it: placeholders their
    kernels never read."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=16)
def _no_h(device: torch.device, Hv: int, K: int, V: int) -> torch.Tensor:
    """``[1, Hv, K, V]`` fp32: the h of a launch that stores none (never read; Hv, K, V
    must match the call's, which the launcher checks)."""
    return torch.empty(1, Hv, K, V, dtype=torch.float32, device=device)


def _walk_args(walks, device: torch.device) -> tuple:
    """The last three arguments of a kernel that searches the bounded split's walks
    (``chunk_fwd_ws`` / ``chunk_bwd_dh`` with ``warmup``): the rule's ``kernel_args``
    (``flash_qla.segments.WalkStarts`` / ``WalkEnds``), or unread placeholders."""
    if walks is None:
        return _no_walk(device), _no_walk(device), 0.0
    return walks.kernel_args


def _fused(q, k, v, g_cumsum, beta, A, layout: ChunkLayout, *, scale, initial_state,
           num_chunks: int | None, alloc, tiling: tuple | str | None = None,
           walks=None, h_in_dtype: bool = False, states_only: bool = False):
    """Run the fused chunk-recurrent kernel on packed inputs.

    q, k ``[Tt, Hk, K]``; v ``[Tt, Hv, V]``; g_cumsum, beta ``[Tt, Hv]`` fp32;
    A ``[Tt, Hv, C]``. ``num_chunks`` given: also return the chunk-start states h
    ``[NT, Hv, K, V]`` fp32. ``tiling``: ``(block_v, threads[, stages])`` or a name in
    ``TRANSPOSED_KERNELS``, overriding :func:`fused_plan`'s choice (tuning).
    ``walks``: the bounded split's walk rule (``flash_qla.segments.WalkStarts``), run
    by ``chunk_fwd_ws`` with ``warmup``, which searches each walk's start itself (the
    sequences of ``layout`` are the segments). ``h_in_dtype`` stores h in q's dtype
    instead of fp32 (``chunk_fwd_ws`` only: with ``walks``, or where the plan picks it;
    with o, the forward keeping h for its backward, or ``states_only``).
    ``states_only`` (the backward's recompute of h): where the kernel is
    ``chunk_fwd_ws``, o is neither computed nor written (left as allocated).
    Returns ``(o [Tt, Hv, V], final_state [N, Hv, K, V], h)``.
    """
    Tt, Hk, K = q.shape
    Hv, V = v.shape[1:]
    o = alloc(Tt, Hv, V, dtype=q.dtype, device=q.device)
    final_state = torch.empty(layout.num_seqs, Hv, K, V, dtype=torch.float32, device=q.device)
    has_h0 = initial_state is not None
    h0 = initial_state.contiguous() if has_h0 else final_state   # unread when not has_h0
    store_h = num_chunks is not None
    if walks is None and tiling is None:
        tiling = fused_plan(layout.num_seqs, Hv, K, V, _sm_count(q.device))[0]
    if h_in_dtype and walks is None and tiling != "ws":
        raise ValueError("h_in_dtype: only chunk_fwd_ws stores h in q's dtype (the "
                         f"bounded split's walks, or the ws plan); the plan is {tiling!r}")
    # at least one row: h in q's dtype leaves by TMA, whose descriptor needs every
    # dimension >= 1 (a varlen batch of empty sequences has no chunk); the extra row is
    # never written, the caller gets the first num_chunks
    h = (final_state.new_empty(max(num_chunks, 1), Hv, K, V,
                               dtype=q.dtype if h_in_dtype else torch.float32)
         if store_h else _no_h(q.device, Hv, K, V))
    dtype = _DTYPE_NAMES[q.dtype]
    if walks is not None:                                # the bounded split
        kernel = launcher(chunk_fwd_ws_kernel, dtype, K, V, has_h0, store_h, *static_flags(
            True, h_in_dtype and store_h, states_only and store_h))
        extra = _walk_args(walks, q.device)
    else:
        extra = _walk_args(None, q.device) if tiling == "ws" else ()   # ws only: unread
        if tiling == "ws" and store_h and (states_only or h_in_dtype):
            kernel = launcher(chunk_fwd_ws_kernel, dtype, K, V, has_h0, store_h,
                              *static_flags(False, h_in_dtype, states_only))
        elif tiling in TRANSPOSED_KERNELS:
            kernel = launcher(TRANSPOSED_KERNELS[tiling], dtype, K, V, has_h0, store_h)
        else:
            kernel = launcher(chunk_fwd_kernel, dtype, K, V, has_h0, store_h, *tiling)
    kernel(
        q, k, v, g_cumsum, beta, A, layout.cu_seqlens, layout.chunk_offsets,
        h0, float(scale), o, final_state, h, *extra)
    return o, final_state, (h[:num_chunks] if store_h else None)


def _output_alloc(cu_seqlens, cu_seqlens_cpu, num_tokens: int):
    """torch.zeros where tokens past ``cu_seqlens[-1]`` (padding) get outputs, else
    torch.empty."""
    padded = _zero_padding_rows(cu_seqlens, cu_seqlens_cpu, num_tokens)
    return torch.zeros if padded else torch.empty


def _keeps_states(layout: ChunkLayout, cu_seqlens_cpu, Hv: int, K: int, V: int,
                  device) -> bool:
    """Whether the unsplit forward keeps h for its backward when asked
    (``Kernels.keeps_states``): where the backward reads h in q's dtype from
    ``chunk_fwd_ws`` (``backward.states_in_dtype``), and the chunk count is known
    without a host sync (dense, or ``cu_seqlens_cpu``). Elsewhere the backward
    recomputes h (fp32 h would cost twice the memory)."""
    from .backward import states_in_dtype

    return chunks_known(layout, cu_seqlens_cpu) and states_in_dtype(layout, Hv, K, V, device)


def _fused_outputs(q, k_p, v, g_cumsum_p, beta_p, A_p, layout: ChunkLayout, alloc, *, scale,
                   initial_state, cu_seqlens_cpu, output_final_state, output_h,
                   keep_states=False):
    """:func:`_fused` on the packed k, g_cumsum, beta, A, returning ``(o, h, final_state)``
    in the layout of ``Kernels.fwd`` (o ``[B, T, Hv, V]``; dense h ``[B, NT/B, ...]``).
    ``keep_states`` (without ``output_h``): h's place holds the chunk states the
    backward reads, ``[NT, Hv, K, V]`` in q's dtype, where :func:`_keeps_states`, else
    None."""
    B, T, _, K = q.shape
    Hv, V = v.shape[2:]
    keep = (keep_states and not output_h
            and _keeps_states(layout, cu_seqlens_cpu, Hv, K, V, q.device))
    o, final_state, h = _fused(
        _packed(q), k_p, _packed(v), g_cumsum_p, beta_p, A_p, layout, scale=scale,
        initial_state=initial_state, alloc=alloc, h_in_dtype=keep,
        num_chunks=total_chunks(layout, cu_seqlens_cpu) if output_h or keep else None)
    if output_h:
        h = h.view(B, -1, Hv, K, V)
    return o.view(B, T, Hv, V), h, final_state if output_final_state else None


def fused_fwd(q, k, v, g_cumsum, beta, A, *, scale, initial_state, cu_seqlens,
              cu_seqlens_cpu, output_final_state, output_h):
    """The fused kernel alone, from a prepare's outputs (``Kernels.fwd_prepared``):
    g_cumsum ``[B,T,Hv]`` fp32 and A ``[B,T,Hv,C]`` as :func:`chunk_fwd` returned them
    for the same tokens and chunk boundaries. Returns (o, h, final_state)."""
    return _fused_outputs(
        q, _packed(k), v, _packed(g_cumsum, torch.float32), _packed(beta, torch.float32),
        _packed(A), layout_for(q, cu_seqlens),
        _output_alloc(cu_seqlens, cu_seqlens_cpu, q.shape[0] * q.shape[1]), scale=scale,
        initial_state=initial_state, cu_seqlens_cpu=cu_seqlens_cpu,
        output_final_state=output_final_state, output_h=output_h)


def _prepare(q, k, g, beta, cu_seqlens, cu_seqlens_cpu, static: bool = False):
    """The call's layout and output allocator, and the prepare kernel on it: returns
    ``(layout, alloc, k_p [Tt, Hk, K], beta_p [Tt, Hv] fp32, g_cumsum [Tt, Hv] fp32,
    A [Tt, Hv, C])`` (packed) for the fused kernel. ``static``: see :func:`layout_for`."""
    B, T = q.shape[:2]
    layout = layout_for(q, cu_seqlens, static)
    alloc = _output_alloc(cu_seqlens, cu_seqlens_cpu, B * T)
    k_p, beta_p = _packed(k), _packed(beta, torch.float32)       # [Tt, Hk, K], [Tt, Hv]
    Tt, Hv = beta_p.shape
    g_cumsum = alloc(Tt, Hv, dtype=torch.float32, device=k_p.device)
    A = alloc(Tt, Hv, CHUNK, dtype=k_p.dtype, device=k_p.device)
    launcher(prepare_kernel(), _DTYPE_NAMES[k_p.dtype], k_p.shape[-1])(
        k_p, _packed(g, torch.float32), beta_p, layout.cu_seqlens, layout.chunk_idx,
        g_cumsum, A)
    return layout, alloc, k_p, beta_p, g_cumsum, A


def warmup_fwd(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
               starts, keep_states=False):
    """``Kernels.fwd_warmup``: the bounded segment split in one pass
    (``flash_qla.segments.warmup_fwd``). ``cu_seqlens`` / ``cu_seqlens_cpu`` hold the
    segments (``[Nseg + 1]``); ``starts`` is the walk rule
    (``flash_qla.segments.WalkStarts``), searched by the kernel. Returns ``(g_cumsum
    [B,T,Hv], A [B,T,Hv,C], o [B,T,Hv,V], final_state [Nseg,Hv,K,V])``, the final state
    of every segment; with ``keep_states`` (``Kernels.keeps_states``) also the chunk
    states ``chunk_bwd_warmup`` reads (``[NT, Hv, K, V]``, q's dtype with
    ``traits.BWD_STATES_IN_DTYPE``), or None where the chunk count would need a sync."""
    B, T = q.shape[:2]
    Hv, V = v.shape[2:]
    layout, alloc, k_p, beta_p, g_cumsum, A = _prepare(q, k, g, beta, cu_seqlens,
                                                       cu_seqlens_cpu, static=True)
    keep = keep_states and chunks_known(layout, cu_seqlens_cpu)
    o, final_state, h = _fused(
        _packed(q), k_p, _packed(v), g_cumsum, beta_p, A, layout, scale=scale,
        initial_state=initial_state, alloc=alloc, walks=starts,
        num_chunks=total_chunks(layout, cu_seqlens_cpu) if keep else None,
        h_in_dtype=keep and traits.BWD_STATES_IN_DTYPE)
    outs = (g_cumsum.view(B, T, Hv), A.view(B, T, Hv, CHUNK), o.view(B, T, Hv, V),
            final_state)
    return (*outs, h) if keep_states else outs


def chunk_fwd(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
              output_final_state, output_h, keep_states=False):
    """Forward; returns (g_cumsum, A, o, h, final_state) (see Kernels.fwd; with
    ``keep_states``, h's place holds the states the backward reads, or None)."""
    B, T = q.shape[:2]
    Hv = v.shape[2]
    layout, alloc, k_p, beta_p, g_cumsum, A = _prepare(q, k, g, beta, cu_seqlens,
                                                       cu_seqlens_cpu)
    o, h, final_state = _fused_outputs(
        q, k_p, v, g_cumsum, beta_p, A, layout, alloc, scale=scale,
        initial_state=initial_state, cu_seqlens_cpu=cu_seqlens_cpu,
        output_final_state=output_final_state, output_h=output_h, keep_states=keep_states)
    return g_cumsum.view(B, T, Hv), A.view(B, T, Hv, CHUNK), o, h, final_state
