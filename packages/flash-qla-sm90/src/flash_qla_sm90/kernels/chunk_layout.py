"""Where the chunks are: per-call index tensors built on the device, without a host sync.

Every kernel works on the packed token layout ``[Tt, H, D]`` (dense ``[B, T]`` inputs are
B sequences of length T). A chunk never straddles two sequences, so the chunk list
depends on ``cu_seqlens``. Its length is only known on the device; the grids use the
upper bound ``ceil(Tt / C) + N`` and mark the unused rows with -1, which keeps the
path free of host syncs; under CUDA-graph capture the caches below are bypassed
(``forward.layout_for``), except for offsets that never change (:func:`static_layout`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flash_qla.utils import tensor_cache

from .traits import CHUNK


@dataclass(frozen=True)
class ChunkLayout:
    cu_seqlens: torch.Tensor      # [N+1] int32
    chunk_offsets: torch.Tensor   # [N+1] int32, first chunk of each sequence
    chunk_idx: torch.Tensor       # [NTmax, 2] int32, (sequence, chunk in sequence) or -1
    num_seqs: int                 # N
    num_chunks_max: int           # NTmax >= real number of chunks
    num_chunks: int | None        # the real number, when known on the host (dense)


def _build(cu_seqlens: torch.Tensor, num_tokens: int, num_chunks: int | None = None) -> ChunkLayout:
    cu = cu_seqlens.to(torch.int32)
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]                                          # [N]
    chunks = (lens + CHUNK - 1) // CHUNK                             # [N]
    offsets = torch.zeros(n + 1, dtype=torch.int32, device=cu.device)
    offsets[1:] = torch.cumsum(chunks, 0)                            # [N+1]
    nt_max = max(1, -(-num_tokens // CHUNK) + n)
    idx = torch.arange(nt_max, dtype=torch.int32, device=cu.device)  # [NTmax]
    seq = torch.searchsorted(offsets[1:], idx, right=True).clamp_(max=max(n - 1, 0))
    live = idx < offsets[-1]
    chunk_idx = torch.stack(
        [torch.where(live, seq.to(torch.int32), -1),
         torch.where(live, idx - offsets[seq], -1)], dim=1).contiguous()  # [NTmax, 2]
    return ChunkLayout(cu, offsets, chunk_idx, n, nt_max, num_chunks)


@tensor_cache
def varlen_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> ChunkLayout:
    """Layout for packed sequences (cached while the same cu_seqlens tensor is passed)."""
    return _build(cu_seqlens, num_tokens)


@functools.lru_cache(maxsize=64)
def dense_layout(batch: int, seq_len: int, device: torch.device) -> ChunkLayout:
    """Layout for B sequences of length T (the 64 most recent shapes are cached)."""
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len
    return _build(cu, batch * seq_len, num_chunks=batch * -(-seq_len // CHUNK))


#: Attribute of a static offsets tensor: ``{num_tokens: layout}``, only ever added to
#: (a graph may have captured any of them).
_KEPT = "_flash_qla_chunk_layouts"


def static_layout(cu_seqlens: torch.Tensor, num_tokens: int, capturing: bool) -> ChunkLayout:
    """Layout for offsets that never change once made: a split's segment offsets
    (``flash_qla.segments``, whose plan keeps them, for the process's life once a graph
    captured them). Built outside any capture and kept on the tensor itself, one per
    token count (a dense input and a padded varlen one can share a plan), so a capture
    reuses it instead of recording the ~15 index kernels of :func:`_build` into the graph
    (v16: +34 us per replay of a bounded forward). Inside a capture, with no layout kept
    for the count, it is built uncached: its tensors are the graph's, filled only when
    it replays, so nothing outside the graph may see them. (A plan first built inside a
    capture never reaches an eager call: ``segments._plan_for``.)"""
    kept = getattr(cu_seqlens, _KEPT, None)
    if kept is not None and num_tokens in kept:
        return kept[num_tokens]
    layout = _build(cu_seqlens, num_tokens)
    if not capturing:
        if kept is None:
            kept = {}
            setattr(cu_seqlens, _KEPT, kept)
        kept[num_tokens] = layout
    return layout
