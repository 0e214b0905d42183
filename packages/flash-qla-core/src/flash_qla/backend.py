"""The contract between the core and a kernel backend.

A *backend* is what a kernel package (``flash-qla-sm90`` ...) registers under the
entry-point group ``flash_qla.backends``. The registered object is a
:class:`BackendSpec`: light to import (no TileLang, no compilation, no CUDA
initialisation) and able to say, without loading any kernel, whether it can run a
call. Kernels are loaded on first use through :meth:`BackendSpec.load`.

Shape vocabulary (used by every docstring in the package, see
``docs/gdn-math.md``):

    B   batch size (1 when ``cu_seqlens`` is given)
    T   tokens per batch row (packed tokens when ``cu_seqlens`` is given)
    N   number of sequences (B, or len(cu_seqlens) - 1)
    Hk  q/k heads;  Hv value heads, Hv = G * Hk (GVA, G >= 1)
    K   q/k head dim;  V value head dim
    C   chunk size (64 on every backend so far)
    NT  number of chunks (sum over sequences of ceil(len / C))

The low-level kernel API (what :meth:`Kernels.fwd` and :meth:`Kernels.bwd` take) is
always in the canonical layout: state ``[N, Hv, K, V]`` fp32, no q/k L2-norm, the raw
log gate. Layout conversions and the optional pre-passes are done by the core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Bumped whenever the signature or semantics of ``Kernels.fwd``/``Kernels.bwd``
#: change. A backend declaring another version is refused with a pip command.
KERNEL_API_VERSION = 1


class Kernels(Protocol):
    """What :meth:`BackendSpec.load` returns."""

    def fwd(self, q, k, v, g, beta, *, scale: float, initial_state, cu_seqlens,
            cu_seqlens_cpu, output_final_state: bool, output_h: bool):
        """Forward of one call; returns ``(g_cumsum, A, o, h, final_state)``.

        q, k ``[B,T,Hk,K]``; v ``[B,T,Hv,V]``; g, beta ``[B,T,Hv]``;
        initial_state ``[N,Hv,K,V]`` fp32 or None; cu_seqlens ``[N+1]`` int32/int64
        on the device or None; cu_seqlens_cpu the same on the host or None (lets a
        backend plan without a host sync).
        Returns g_cumsum fp32 ``[B,T,Hv]`` (chunk-local cumsum of g), A ``[B,T,Hv,C]``
        in q's dtype (the gate-free inverse), o ``[B,T,Hv,V]`` in q's dtype,
        h ``[B,NT_b,Hv,K,V]`` (chunk-start states; dense: NT_b = ceil(T/C) chunks per
        batch row; varlen: B = 1 and NT_b = all chunks of all sequences) or None, final_state
        ``[N,Hv,K,V]`` fp32 or None.
        """

    def bwd(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale: float,
            initial_state, cu_seqlens, cu_seqlens_cpu):
        """Backward; returns ``(dq, dk, dv, dbeta, dg, dh0)``.

        dg is w.r.t. the raw per-token gate g (fp32), dbeta in beta's dtype, dq/dk/dv
        in q's dtype, dh0 fp32 ``[N,Hv,K,V]`` or None when initial_state is None.
        """

    # Optional: ``fwd_prepared(q, k, v, g_cumsum, beta, A, *, scale, initial_state,
    # cu_seqlens, cu_seqlens_cpu, output_final_state, output_h) -> (o, h, final_state)``:
    # ``fwd`` without its prepare, from the g_cumsum and A that ``fwd`` returned for the
    # same tokens and chunk boundaries (the segment split reuses them in its later passes;
    # without it, every pass recomputes them).
    # Optional: ``fwd_pool(q, k, v, g, beta, *, scale, pool, state_indices, v_first,
    # cu_seqlens, cu_seqlens_cpu) -> o``: the inference forward on an engine's state pool
    # (``flash_qla.state_pool``): pool ``[P, Hv, K, V]`` (``v_first``: ``[P, Hv, V, K]``),
    # contiguous, fp32/bf16/fp16; sequence n starts from row ``state_indices[n]`` (zeros
    # for a negative index) and its final state is written to that row in the pool's
    # dtype, in place (nothing for a negative index). Without it, and for calls split
    # into segments, the core gathers the rows, runs ``fwd`` and scatters the states.
    # Optional: ``recurrent(q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
    # state_indices, output_final_state, v_first) -> (o, final_state)``: the token-by-token
    # recurrence (``flash_qla.recurrent``, decode): with ``state_indices`` the pool
    # ``initial_state`` (as ``fwd_pool``'s, fp32/bf16/fp16, either layout) is updated in
    # place and returned; else a contiguous fp32 ``initial_state`` (or None) in the
    # caller's layout (``v_first``: ``[N, Hv, V, K]``) and a new fp32 final state in that
    # layout. beta arrives as the caller gave it (fp32 or q's dtype). Without it, the core
    # runs the reference recurrence.
    # Optional: ``beta_dtype``, a torch dtype: the dtype the kernels read beta in; the
    # autograd Function converts beta to it once per training step (the forward and the
    # backward then receive it) instead of each pass converting its own copy. Only for
    # exact upcasts (bf16 / fp16 to fp32).
    # Optional, with it: ``fwd_converts_beta = True``: ``fwd``, ``fwd_pool`` and
    # ``fwd_warmup`` also take beta in q's dtype and convert it themselves (in their first
    # kernel); a call without autograd then passes beta as it is (no conversion launch).
    # Optional: ``plan_segment_len(bounds, Hv, K, V, device, bounded, dominant=True)
    # -> int | None``, the backend's automatic segment-parallelism choice from host
    # sequence offsets ``bounds`` ``[N + 1]`` (None: no split) for the bounded split
    # (``bounded``) or the exact one. ``dominant`` False: no split of a batch whose
    # (sequence, head) pairs already fill the GPU (the core passes it for a capture's
    # guess of the lengths, one sequence holding nearly every token, and for a captured
    # varlen training step, whose backward runs unsplit). Backends without it never
    # split on their own; the core asks with the lengths on the host, and inside a
    # CUDA-graph capture of a varlen batch with a guess of them.
    # Optional: ``fwd_warmup(q, k, v, g, beta, *, scale, initial_state, cu_seqlens,
    # cu_seqlens_cpu, starts) -> (g_cumsum, A, o, final_state)``: the bounded segment
    # split in one pass (``flash_qla.segments.warmup_fwd``): ``cu_seqlens`` holds the
    # segments of the ``B * T`` tokens of ``[B, T, ...]`` inputs taken as packed (a dense
    # batch is passed as is; outputs in the inputs' ``[B, T]``), ``starts`` (a
    # ``flash_qla.segments.WalkStarts``) is the walk rule: ``starts(g_cumsum)`` returns
    # ``(walk, h0_from)`` ``[Nseg, Hv]`` int32 (where each (segment, head) starts its
    # recurrence, and from which sequence's initial state, -1 for zero), or a kernel
    # searches the same walks itself from ``starts.seq_start``,
    # ``starts.seq_index`` and ``starts.log_bound``; o is stored only from each
    # segment's start; final_state ``[Nseg, Hv, K, V]`` is every segment's.
    # Optional, with it: ``searches_walks = True``: ``fwd_warmup`` never calls
    # ``starts(g_cumsum)`` (its kernel searches the walks from ``starts.seq_start`` /
    # ``seq_index`` / ``log_bound``) and takes ``cu_seqlens_cpu=None``: the core may then
    # plan the split on the device, from live offsets, inside a CUDA-graph capture of a
    # varlen batch (``flash_qla.segments``; ``starts.plan`` is then a device plan, empty
    # segments at its end).
    # Optional: ``keeps_states = True``: the chunk-start states kept from the training
    # forward for the backward instead of recomputed there (the autograd Function with
    # ``save_chunk_states``). ``fwd`` and ``fwd_warmup`` then take ``keep_states: bool``
    # (False when not passed) and ``bwd`` / ``bwd_warmup`` take ``states`` (None when not
    # passed). With ``keep_states`` (and ``output_h`` False), ``fwd`` returns in h's place
    # the states its backward reads, in a dtype and packing of the backend's choice, or
    # None where it keeps none for this call (say, where their size would need a host
    # sync), and ``fwd_warmup`` returns them as a fifth element; the backward methods
    # given them skip their recompute (None: they recompute).
    # Optional, with it: ``bwd_warmup(q, k, v, g_cumsum, beta, A, do, *, dht, scale,
    # initial_state, cu_seqlens, cu_seqlens_cpu, starts, ends) -> (dq, dk, dv, dbeta, dg,
    # dh0)``: the backward of that split (``flash_qla.segments.warmup_bwd``), on the same
    # segments (``[B, T, ...]`` inputs and gradients, as ``fwd_warmup``); ``starts`` as
    # above (the chunk states are recomputed by the same forward walks), ``ends`` (a
    # ``flash_qla.segments.WalkEnds``) the rule of the reverse walks (each segment's dS
    # sweep starts after its end at the first chunk boundary where the gates decayed
    # below ``ends.log_bound``, from a zero dS, or at its sequence's end
    # from dht); dh0 ``[Nseg, Hv, K, V]`` per segment (None without an initial state).


def searches_walks(kernels) -> bool:
    """Whether ``kernels.fwd_warmup`` searches the bounded split's walks in its kernel
    (``Kernels.searches_walks``, optional): a split planned on the device will do."""
    return getattr(kernels, "searches_walks", False) is True


def keeps_states(kernels) -> bool:
    """Whether ``kernels`` keeps the forward's chunk states for its backward
    (``Kernels.keeps_states``, optional)."""
    return getattr(kernels, "keeps_states", False) is True


@dataclass(frozen=True)
class BackendSpec:
    """A backend as the core sees it before any kernel is loaded.

    Attributes:
        name: entry-point name, e.g. ``"sm90"`` or ``"torch"``.
        distribution: the pip distribution that ships it, e.g. ``"flash-qla-sm90"``.
        version: that distribution's version.
        kernel_api_version: must equal :data:`KERNEL_API_VERSION`.
        capabilities: CUDA compute capabilities served, e.g. ``((9, 0),)``; empty
            for a backend that runs on any device (``torch``).
        head_dims: supported ``(K, V)`` pairs; empty means any.
        dtypes: supported q/k/v dtypes by name (``"bfloat16"``...).
        loader: zero-argument callable returning a :class:`Kernels`; called once.
        notes: free text shown by ``python -m flash_qla info``.
    """

    name: str
    distribution: str
    version: str
    kernel_api_version: int
    capabilities: tuple[tuple[int, int], ...]
    head_dims: tuple[tuple[int, int], ...]
    dtypes: tuple[str, ...]
    loader: Callable[[], Any] = field(repr=False, compare=False)
    notes: str = ""

    def rejection_reason(self, *, K: int, V: int, dtype_name: str) -> str | None:
        """None when this backend can run a call with these statics, else why not."""
        if self.head_dims and (K, V) not in self.head_dims:
            dims = ", ".join(f"K={k}, V={v}" for k, v in self.head_dims)
            return f"{self.name} supports head dims ({dims}); got K={K}, V={V}"
        if self.dtypes and dtype_name not in self.dtypes:
            return f"{self.name} supports dtypes {list(self.dtypes)}; got {dtype_name}"
        return None
