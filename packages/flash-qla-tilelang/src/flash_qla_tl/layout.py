"""Shared host helpers of both directions: where the chunks are, and how the kernels'
arguments are laid out.

Every kernel works on the packed token layout ``[Tt, H, D]`` (dense ``[B, T]`` inputs are
B sequences of length T; :func:`packed`). A chunk never straddles two sequences, so the
chunk list depends on ``cu_seqlens``. Its length is only known on the device; the grids
use the upper bound ``ceil(Tt / C) + N`` and mark the unused rows with -1, which keeps
the path free of host syncs (:class:`ChunkLayout`, built on a device by one launch of
``chunk_layout_kernel``); under CUDA-graph capture the caches below are bypassed
(:func:`layout_for`), except for offsets that never change (:func:`static_layout`).
Outputs are written at real tokens only; the rows of padding tokens (after
``cu_seqlens[-1]``) are zeroed by :func:`output_alloc`, on the device when only the
device knows where they start. The rest: dtype names, static flags and placeholders of
the launches, chunk counts, the SM count.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from flash_qla.offsets import kept_offsets, version_of
from flash_qla.utils import cast, tensor_cache
from flash_qla.validation import is_capturing

from .arch import Arch
from .kernels import chunk_layout_kernel, zero_tail_kernel
from .kernels.traits import CHUNK
from .launch import launcher

#: torch dtype -> the dtype name the kernel builders take.
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: state-pool dtype -> its name (``chunk_fwd_ws_kernel``'s ``pool_dtype``).
POOL_DTYPE_NAMES = {torch.float32: "float32", **DTYPE_NAMES}


@dataclass(frozen=True)
class ChunkLayout:
    cu_seqlens: torch.Tensor      # [N+1] int32
    chunk_offsets: torch.Tensor   # [N+1] int32, first chunk of each sequence
    chunk_idx: torch.Tensor       # [NTmax, 2] int32, (sequence, chunk in sequence) or -1
    num_seqs: int                 # N
    num_chunks_max: int           # NTmax >= real number of chunks
    num_chunks: int | None        # the real number, when known on the host (dense)


def _build(cu_seqlens: torch.Tensor, num_tokens: int, arch: Arch | None,
           num_chunks: int | None = None) -> ChunkLayout:
    """The layout of ``cu_seqlens`` for ``num_tokens`` tokens: on a CUDA device one
    launch of ``chunk_layout_kernel`` built for ``arch`` (no host sync; a CUDA graph
    records that one launch), on the host (``arch`` None, or CPU offsets: the planner's
    and host path's tests) :func:`_build_on_host`, the same formula in torch ops."""
    cu = cu_seqlens.to(torch.int32).contiguous()
    n = cu.numel() - 1
    nt_max = max(1, -(-num_tokens // CHUNK) + n)
    if arch is None or not cu.is_cuda:
        return _build_on_host(cu, nt_max, num_chunks)
    offsets = torch.empty(n + 1, dtype=torch.int32, device=cu.device)        # [N+1]
    chunk_idx = torch.empty(nt_max, 2, dtype=torch.int32, device=cu.device)  # [NTmax, 2]
    launcher(chunk_layout_kernel, arch)(cu, offsets, chunk_idx)
    return ChunkLayout(cu, offsets, chunk_idx, n, nt_max, num_chunks)


def _build_on_host(cu: torch.Tensor, nt_max: int, num_chunks: int | None) -> ChunkLayout:
    """:func:`_build` in torch ops (~15 of them, each a launch on a device): chunk
    counts, their cumsum, and a search of each grid row's sequence."""
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]                                          # [N]
    chunks = (lens + CHUNK - 1) // CHUNK                             # [N]
    offsets = torch.zeros(n + 1, dtype=torch.int32, device=cu.device)
    offsets[1:] = torch.cumsum(chunks, 0)                            # [N+1]
    idx = torch.arange(nt_max, dtype=torch.int32, device=cu.device)  # [NTmax]
    seq = torch.searchsorted(offsets[1:], idx, right=True).clamp_(max=max(n - 1, 0))
    live = idx < offsets[-1]
    chunk_idx = torch.stack(
        [torch.where(live, seq.to(torch.int32), -1),
         torch.where(live, idx - offsets[seq], -1)], dim=1).contiguous()  # [NTmax, 2]
    return ChunkLayout(cu, offsets, chunk_idx, n, nt_max, num_chunks)


@tensor_cache
def varlen_layout(cu_seqlens: torch.Tensor, num_tokens: int,
                  arch: Arch | None = None) -> ChunkLayout:
    """Layout for packed sequences (cached while the same cu_seqlens tensor is passed;
    ``arch``: see :func:`_build`)."""
    return _build(cu_seqlens, num_tokens, arch)


@functools.lru_cache(maxsize=64)
def dense_layout(batch: int, seq_len: int, device: torch.device,
                 arch: Arch | None = None) -> ChunkLayout:
    """Layout for B sequences of length T (the 64 most recent shapes are cached)."""
    return _build(dense_offsets(batch, seq_len, device), batch * seq_len, arch,
                  num_chunks=batch * -(-seq_len // CHUNK))


def dense_offsets(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """``[B + 1]`` int32 offsets of B sequences of length T; outside a CUDA-graph capture
    the 64 most recent shapes' are cached (a tensor made while capturing is filled only
    when the graph replays, so it is never cached)."""
    if is_capturing(device):
        return _dense_offsets.__wrapped__(batch, seq_len, device)
    return _dense_offsets(batch, seq_len, device)


@functools.lru_cache(maxsize=64)
def _dense_offsets(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len


#: Attribute of a static offsets tensor: ``{num_tokens: layout}``, only ever added to
#: (a graph may have captured any of them).
_KEPT = "_flash_qla_chunk_layouts"


def static_layout(cu_seqlens: torch.Tensor, num_tokens: int, capturing: bool,
                  arch: Arch | None = None) -> ChunkLayout:
    """Layout for offsets that never change once made: a split's segment offsets
    (``flash_qla.segments``, whose plan keeps them, for the process's life once a graph
    captured them). Built outside any capture and kept on the tensor itself, one per
    token count (a dense input and a padded varlen one can share a plan), so a capture
    reuses it instead of recording :func:`_build`'s launch into the graph. Inside a capture,
    with no layout kept for the count, it is built uncached: its tensors are the graph's,
    filled only when it replays, so nothing outside the graph may see them. (A plan
    first built inside a capture never reaches an eager call: ``segments._plan_for``.)"""
    kept = getattr(cu_seqlens, _KEPT, None)
    if kept is not None and num_tokens in kept:
        return kept[num_tokens]
    layout = _build(cu_seqlens, num_tokens, arch)
    if not capturing:
        if kept is None:
            kept = {}
            setattr(cu_seqlens, _KEPT, kept)
        kept[num_tokens] = layout
    return layout


def layout_for(q: torch.Tensor, cu_seqlens: torch.Tensor | None, arch: Arch,
               static: bool = False) -> ChunkLayout:
    """The call's chunk layout; cached in eager mode, rebuilt inside a CUDA-graph capture
    (the graph then recomputes it from the live ``cu_seqlens`` at every replay, and no
    cache entry points into the graph's memory) and for inference tensors (whose in-place
    rewrites cannot be seen). ``static``: ``cu_seqlens`` never
    changes (a split's segment offsets): one layout built outside any capture serves
    every call and capture (:func:`static_layout`). ``arch``: the arch whose
    ``chunk_layout_kernel`` builds it on a device."""
    B, T = q.shape[:2]
    if static and cu_seqlens is not None:
        return static_layout(cu_seqlens, B * T, is_capturing(q.device), arch)
    dense, varlen = dense_layout, varlen_layout
    if is_capturing(q.device):
        dense, varlen = dense.__wrapped__, varlen.__wrapped__        # uncached builders
    elif cu_seqlens is not None and version_of(cu_seqlens) is None:
        # an inference tensor has no version counter: an engine refilling the same
        # offsets tensor in place would get the old layout (the host offsets, read per
        # call for such tensors, would disagree with it); one launch per call instead
        varlen = varlen.__wrapped__
    return dense(B, T, q.device, arch) if cu_seqlens is None else varlen(cu_seqlens, B * T,
                                                                         arch)


def packed(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T, ...] -> contiguous [B*T, ...], optionally cast."""
    x = x.flatten(0, 1)           # a view where it can be; no shape read in Python (~1 us)
    return (x if dtype is None else cast(x, dtype)).contiguous()


def static_flags(*flags: bool) -> tuple[bool, ...]:
    """Trailing boolean arguments of a kernel builder without its trailing False ones,
    so a call with the defaults hits the same in-memory kernel (and launcher) as a call
    that omits them."""
    flags = tuple(flags)
    while flags and not flags[-1]:
        flags = flags[:-1]
    return flags


def padding_start(layout: ChunkLayout, cu_seqlens_cpu, num_tokens: int) -> int | None:
    """Where the call's padding tokens (after ``cu_seqlens[-1]``, in no sequence) start:
    None when there are none (dense, or host offsets ending at the last token), the first
    one from host offsets, or -1 when only the device knows (its offsets are read by
    ``zero_tail_kernel``, no host sync)."""
    if layout.num_chunks is not None:                         # dense: no padding
        return None
    if cu_seqlens_cpu is not None:
        end = int(cu_seqlens_cpu[-1])
        return None if end >= num_tokens else end
    return -1


def output_alloc(layout: ChunkLayout, cu_seqlens_cpu, num_tokens: int, *, arch: Arch):
    """The allocator of the outputs the kernels write only at real tokens:
    ``alloc(*shape, dtype, device, token_dim=0)`` (``num_tokens`` along ``token_dim``),
    torch.empty with the rows of the padding tokens zeroed (:func:`zero_padding`), never
    a memset of the whole output."""
    start = padding_start(layout, cu_seqlens_cpu, num_tokens)

    def alloc(*shape, dtype, device, token_dim: int = 0):
        x = torch.empty(*shape, dtype=dtype, device=device)
        if start is not None:
            zero_padding(x, start, layout, arch=arch, token_dim=token_dim)
        return x

    return alloc


def zero_padding(x: torch.Tensor, start: int, layout: ChunkLayout, *, arch: Arch,
                 token_dim: int = 0) -> None:
    """Zero, in place, the rows of ``x``'s dimension ``token_dim`` (its tokens) from
    ``start`` on (:func:`padding_start`): one fill of those rows, or with ``start`` -1
    ``zero_tail_kernel`` (from ``layout.cu_seqlens[-1]`` on, read on the device). ``x``
    contiguous, rows a whole number of 4-byte words (any output of ours)."""
    tokens = x.shape[token_dim]
    if start >= 0:
        x.narrow(token_dim, start, tokens - start).zero_()
    elif x.numel():
        words = x.view(torch.int32)
        launcher(zero_tail_kernel, arch)(
            words.view(math.prod(x.shape[:token_dim]), tokens, -1), layout.cu_seqlens)


def state_rows(arch) -> int:
    """Rows per 64-token chunk of the backward's state tensors on ``arch`` (h in q's
    dtype, kept by the training forward or recomputed, and dS1): one per sub-chunk
    (``Arch.sub_chunk``), the unit of its gradient kernel; fp32 h for a caller
    (``output_h``) stays one per chunk."""
    return CHUNK // arch.sub_chunk


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


def walk_chunks(layout: ChunkLayout, cu_seqlens_cpu) -> tuple[int, int]:
    """``(longest, total)``: the chunks of the longest sequence (or segment) of a call and
    of all of them, without a host sync: exact for dense inputs and host offsets
    (``cu_seqlens_cpu``), else upper bounds from the token count (one sequence holding
    every token)."""
    if layout.num_chunks is not None:                        # dense: N equal sequences
        return layout.num_chunks // max(layout.num_seqs, 1), layout.num_chunks
    if cu_seqlens_cpu is not None:
        chunks = host_chunks(cu_seqlens_cpu)
        return max(chunks, default=0), sum(chunks)
    bound = layout.num_chunks_max - layout.num_seqs          # ceil(Tt / C)
    return bound, bound


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the waves of the cost model)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=8)
def no_walk(device: torch.device) -> torch.Tensor:
    """``[1]`` int32: the ``seq_start`` / ``seq_index`` of a forward launch without
    warm-up, and the ``seq_end`` / ``seq_index`` of a sweep without it: placeholders
    their kernels never read."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=16)
def no_h(device: torch.device, Hv: int, K: int, V: int) -> torch.Tensor:
    """``[1, Hv, K, V]`` fp32: the h of a launch that stores none (never read; Hv, K, V
    must match the call's, which the launcher checks)."""
    return torch.empty(1, Hv, K, V, dtype=torch.float32, device=device)


def cta_order(arch: Arch, cu_seqlens_cpu, Hv: int, device: torch.device,
              cu_seqlens: torch.Tensor | None = None) -> tuple:
    """The last two arguments of a launch of one CTA per (sequence, value head)
    (``chunk_state_output``, ``chunk_state_grad``, ``chunk_grads_fused``): ``(order,
    1)``, with ``order`` ``[N]`` int32 on ``device`` the sequences longest first (by
    chunks; ties in packing order), or an unread placeholder and 0 (grid order).

    The block scheduler starts CTAs in index order as SMs free up, so a grid of more
    CTAs than SMs that packs its longest sequence last starts that chain only when an
    earlier CTA ends: six sequences of 1.5k-5k tokens at 32 heads with the longest last
    took 1.41x the longest-first time (H100; list scheduling longest first is within 4/3
    of the best order). Ordered only where it can matter and costs no sync: a CUDA
    device, host offsets known, more CTAs than SMs, lengths not already non-increasing
    (:func:`longest_first`). Inside a CUDA-graph capture the host offsets are
    ``cu_seqlens_cpu`` or the copy an eager call kept of ``cu_seqlens``
    (``flash_qla.offsets.kept_offsets``), and only an order made by an eager call is
    used (then kept for the process's life: replays read it; a replay's other lengths
    get a worse order, never a wrong result, any permutation computes the same). Never
    on an ``arch`` without ``ordered_grid`` (its kernels do not read the order)."""
    if device.type != "cuda" or not arch.ordered_grid:
        return no_walk(device), 0
    capturing = is_capturing(device)
    host = cu_seqlens_cpu
    if host is None and capturing and cu_seqlens is not None:
        host = kept_offsets(cu_seqlens)
    if host is None or (host.numel() - 1) * Hv <= sm_count(device):     # one wave
        return no_walk(device), 0
    key = (_chunks_of(host), Hv, sm_count(device), device)
    if capturing:
        order = _GRAPH_ORDERS.get(key, _ORDERS.get(key))
        if order is not None:
            _GRAPH_ORDERS[key] = order
    else:
        order = _device_order(key)
    return (no_walk(device), 0) if order is None else (order, 1)


@tensor_cache
def _chunks_of(cu_seqlens_cpu: torch.Tensor) -> tuple[int, ...]:
    """:func:`host_chunks` as a tuple (:func:`cta_order`'s key), computed once for the
    host offsets the launches of one call (and of its backward) share."""
    return tuple(host_chunks(cu_seqlens_cpu))


def longest_first(chunks, Hv: int, sms: int) -> list[int] | None:
    """The sequences of ``chunks`` chunks each in longest-first order (ties in packing
    order), or None where grid order does as well: ``len(chunks) x Hv`` CTAs fit one
    wave of ``sms``, or the lengths are already non-increasing.

    >>> longest_first([2, 9, 0, 9, 5], 32, 132)
    [1, 3, 4, 0, 2]
    >>> longest_first([9, 5, 2], 64, 132), longest_first([2, 9], 64, 132)
    (None, None)
    """
    if len(chunks) * Hv <= sms or all(a >= b for a, b in zip(chunks, chunks[1:])):
        return None
    return sorted(range(len(chunks)), key=lambda n: -chunks[n])      # stable


#: Orders made by eager calls, the 64 most recent (chunks, Hv, SMs, device) -> ``[N]``
#: int32 or None; and those a CUDA graph captured, never dropped.
_ORDERS: OrderedDict = OrderedDict()
_GRAPH_ORDERS: dict = {}


def _device_order(key: tuple) -> torch.Tensor | None:
    """:func:`longest_first` as int32 on the key's device, cached per key (a training
    loop and the layers of one step repeat their lengths), copied from pinned memory
    without a stream synchronisation. Never called inside a capture (the copy would be
    the graph's)."""
    if key in _ORDERS:
        _ORDERS.move_to_end(key)
        return _ORDERS[key]
    chunks, Hv, sms, device = key
    order = longest_first(chunks, Hv, sms)
    if order is not None:
        order = torch.tensor(order, dtype=torch.int32).pin_memory().to(device,
                                                                      non_blocking=True)
    _ORDERS[key] = order
    while len(_ORDERS) > 64:
        _ORDERS.popitem(last=False)
    return order


def walk_args(walks, device: torch.device) -> tuple:
    """The last three arguments of a kernel that searches the bounded split's walks
    (``chunk_state_output`` / ``chunk_state_grad`` with ``warmup``): the rule's
    ``kernel_args`` (``flash_qla.segments.WalkStarts`` / ``WalkEnds``), or unread
    placeholders."""
    if walks is None:
        return no_walk(device), no_walk(device), 0.0
    return walks.kernel_args
