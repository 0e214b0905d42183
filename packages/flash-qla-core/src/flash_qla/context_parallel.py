"""Context parallelism (CP): one batch of packed sequences split across the ranks of a
process group, each rank holding a contiguous slice of the tokens.

A sequence whose tokens lie on several ranks needs, on every rank but the first, the
state its previous ranks leave behind; its backward needs, on every rank but the last,
the state gradient its next ranks hand back. Both are affine in what crosses the rank
boundary (``docs/gdn-math.md``, "Segment transition"): the piece of a sequence on rank
``r`` maps the state entering it to the state leaving it as ::

    S_out(r) = M(r) S_in(r) + L(r)            M(r) [Hv, K, K], L(r) [Hv, K, V]

with ``L(r)`` the piece's final state from a zero incoming state (plus the sequence's
own ``initial_state`` when it starts on ``r``) and ``M(r)`` the product of its chunk
transitions (the K x K identity run through the piece with v = 0, as
:mod:`flash_qla.segments` does for segments). The backward is the transpose::

    dS_in(r) = M(r)^T dS_out(r) + B(r)

with ``B(r)`` the gradient of the piece's incoming state when no gradient arrives from
the ranks after it. Per call (``docs/context-parallel.md``):

forward
    1. each rank whose last local sequence continues on the next rank computes ``L`` of
       that sequence's piece, and ``M`` too when the piece is its whole slice (a rank
       inside one sequence);
    2. one ``all_gather`` of ``[header | L | M]`` over the group;
    3. a rank whose first local sequence started on an earlier rank composes the
       ``pre_num_ranks`` summaries before it, ``S = M S + L`` from ``S = 0`` (a few
       small batched GEMMs), and runs its local forward from that incoming state.
backward
    1. a rank whose first local sequence started earlier computes ``B`` of that piece;
    2. one ``all_gather`` of ``B``;
    3. a rank whose last local sequence continues composes the ``post_num_ranks``
       gradients after it, ``X = M^T X + B`` (the ``M`` kept from the forward's
       exchange), adds ``X`` to that sequence's final-state gradient and runs its local
       backward.

Why one all-gather and not a ring (each rank waiting for its predecessor's boundary
state, then sending its own): the ring has P - 1 dependent communication steps on the
critical path of a sequence spanning all P ranks, and each waits for the previous rank's
local pass; the all-gather is one collective on which no rank's compute waits for
another's, followed by at most P - 1 local K x K x V products. Volume: each rank sends
one ``Hv * K * (K + V)`` summary (fp32; fp64 for fp64 inputs) in the forward and one
``Hv * K * V`` gradient in the backward, and receives those of the P - 1 others.

The local passes are the backend's own ``Kernels.fwd`` / ``Kernels.bwd``
(:class:`CPKernels` wraps them), so every backend gets CP; the communication is here and
nowhere else, torch.distributed collectives only (gloo on the CPU, NCCL on GPUs).

FLA compatibility: ``cp_context`` is FLA 0.6.0's ``FLACPContext`` (``fla.ops.cp``), or
any object with the fields listed in :data:`READ_FIELDS` (:class:`CPContext` is this
package's own, :func:`build_cp_context` builds it as FLA's ``build_cp_context`` does).
Unlike FLA, ``initial_state`` and ``output_final_state`` are supported; see
:func:`resolve_cp_context` for where each sequence's states live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .offsets import bounds as sequence_bounds
from .validation import check_cu_seqlens_kind, check_index, state_dtype

__all__ = [
    "READ_FIELDS",
    "CPContext",
    "CPKernels",
    "RankLayout",
    "build_cp_context",
    "context_for_call",
    "resolve_cp_context",
]

#: The fields of FLA's ``FLACPContext`` read here (every other field, e.g. the conv1d
#: ones, ``*_dev`` and the zigzag ``*_by_part`` tuples, is ignored). ``layout`` may be
#: absent (then "contiguous"); ``is_first_rank`` / ``is_last_rank`` may be None.
READ_FIELDS = ("group", "cu_seqlens", "cu_seqlens_cpu", "pre_num_ranks", "post_num_ranks",
               "is_first_rank", "is_last_rank", "layout")

#: Entries of the header each rank puts in front of its forward summary:
#: (pre_num_ranks, post_num_ranks, N, Hv, K, V), checked to agree across the ranks.
_HEADER = 6


# --------------------------------------------------------------------------------------
# The context: FLA's fields, this package's own container and builder
# --------------------------------------------------------------------------------------

@dataclass
class CPContext:
    """The fields of FLA's ``FLACPContext`` that :func:`resolve_cp_context` reads, with
    FLA's names, meanings and order (contiguous layout only).

    Attributes:
        group: the CP process group (``torch.distributed.ProcessGroup``); its ranks hold
            consecutive slices of the packed tokens, rank order = token order.
        cu_seqlens: ``[N_local + 1]`` int32/int64 on q's device: the *local* offsets of
            the sequence pieces on this rank (0 .. local tokens); a sequence crossing a
            rank boundary appears, cut, on every rank it touches.
        cu_seqlens_cpu: the same on the host, or None (then read once from the device).
        is_last_rank: True when this rank's last local sequence ends on this rank
            (``post_num_ranks == 0``); FLA's name. None: not given.
        pre_num_ranks: how many earlier ranks hold tokens of this rank's first local
            sequence (0: it starts here).
        is_first_rank: True when this rank's first local sequence starts on this rank
            (``pre_num_ranks == 0``). None: not given.
        post_num_ranks: how many later ranks hold tokens of this rank's last local
            sequence (0: it ends here).
        layout: "contiguous" (FLA's "zigzag" is not supported).
    """

    group: object = None
    cu_seqlens: Tensor | None = None
    cu_seqlens_cpu: Tensor | None = None
    is_last_rank: bool | None = None
    pre_num_ranks: int | None = None
    is_first_rank: bool | None = None
    post_num_ranks: int | None = None
    layout: str = "contiguous"

    @property
    def num_seqs(self) -> int:
        """Local sequences on this rank (``len(cu_seqlens) - 1``), as FLA's property."""
        return 0 if self.cu_seqlens is None else self.cu_seqlens.numel() - 1


def _rank_and_size(group) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (checked by
    :func:`_check_group`)."""
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def build_cp_context(cu_seqlens: Tensor, group, *,
                     cu_seqlens_cpu: Tensor | None = None) -> CPContext:
    """This rank's :class:`CPContext` for a batch split evenly over ``group``, as FLA's
    ``build_cp_context(cu_seqlens, group)`` builds its contiguous one.

    Rank ``r`` of ``P`` holds the global tokens ``[r * T / P, (r + 1) * T / P)``,
    ``T = cu_seqlens[-1]``; its local sequences are the non-empty intersections of the
    global sequences with that range, in order (empty sequences belong to no rank,
    as in FLA).

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64, the *global* offsets (any device; the local
            ``cu_seqlens`` is int32 on the same device).
        group: the CP process group (initialised; this process a member).
        cu_seqlens_cpu: the same offsets on the host, or None (one device read).

    Returns: a :class:`CPContext` with every field set.

    Raises:
        TypeError / ValueError: a group that is not one, offsets of the wrong kind, not
            starting at 0 or decreasing, or ``T`` not a positive multiple of ``P``
            (naming the argument).
    """
    _check_group("group", group)
    check_cu_seqlens_kind("cu_seqlens", cu_seqlens)
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    check_cu_seqlens_kind("cu_seqlens_cpu", host)
    bounds = [int(x) for x in host.tolist()]
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0, got {bounds}")
    rank, world = _rank_and_size(group)
    total = bounds[-1]
    if total < world or total % world:
        raise ValueError(f"cu_seqlens: the total tokens {total} must be a positive multiple "
                         f"of the group's {world} ranks (one equal slice per rank)")
    part = total // world
    lo, hi = rank * part, (rank + 1) * part
    pieces = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if max(s, lo) < min(e, hi)]
    local = [0, *(min(e, hi) - lo for _, e in pieces)]
    pre = rank - pieces[0][0] // part               # ranks holding the first one's start
    post = (pieces[-1][1] - 1) // part - rank       # ranks holding the last one's rest
    local_cpu = torch.tensor(local, dtype=torch.int32)
    return CPContext(group=group, cu_seqlens=local_cpu.to(cu_seqlens.device),
                     cu_seqlens_cpu=local_cpu, is_last_rank=post == 0, pre_num_ranks=pre,
                     is_first_rank=pre == 0, post_num_ranks=post)


# --------------------------------------------------------------------------------------
# Reading and checking a context
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankLayout:
    """A checked context: where this rank's slice sits among the group's.

    Attributes:
        group, rank, world_size: the process group, this rank in it, its size P.
        pre, post: ``pre_num_ranks`` / ``post_num_ranks`` (0 .. rank, 0 .. P-1-rank).
        cu_seqlens, cu_seqlens_cpu: the local offsets (the latter may be None).
    """

    group: object
    rank: int
    world_size: int
    pre: int
    post: int
    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor | None

    def kernels(self, inner) -> CPKernels:
        """``inner`` (a backend's ``Kernels``) run on this rank's slice, with the
        exchange: a fresh :class:`CPKernels`, one per call."""
        return CPKernels(inner, self)


def _check_group(name: str, group) -> None:
    """``group``: a process group this process is a member of."""
    if group is None:
        raise ValueError(f"{name}: expected the context-parallel process group (a "
                         f"torch.distributed ProcessGroup), got None")
    if not dist.is_available():
        raise ValueError(f"{name}: torch.distributed is not available in this torch build")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{name}: this process is not a member of the group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")


def _rank_count(ctx, name: str, flag_name: str, limit: int, where: str) -> int:
    """``cp_context.<name>`` (pre/post_num_ranks) as an int in [0, limit], checked
    against ``cp_context.<flag_name>`` (is_first/is_last_rank, ``flag == (count == 0)``),
    or derived from the flag alone when it is True and the count None."""
    value, flag = getattr(ctx, name, None), getattr(ctx, flag_name, None)
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"cp_context.{flag_name}: expected a bool or None, got "
                        f"{type(flag).__name__} {flag!r}")
    if value is None:
        if flag is True:
            return 0
        raise ValueError(f"cp_context.{name}: required (how many {where} ranks hold "
                         f"tokens of this rank's {'first' if 'pre' in name else 'last'} "
                         f"sequence), got None")
    value = check_index(f"cp_context.{name}", value, "an int")
    if not 0 <= value <= limit:
        raise ValueError(f"cp_context.{name}: expected 0 .. {limit} (the {where} ranks "
                         f"of this one), got {value}")
    if flag is not None and flag != (value == 0):
        raise ValueError(f"cp_context.{flag_name}={flag} contradicts "
                         f"cp_context.{name}={value}")
    return value


def resolve_cp_context(cp_context) -> RankLayout:
    """Check FLA's ``FLACPContext`` (or any object with its fields, e.g.
    :class:`CPContext`) and return this rank's :class:`RankLayout`.

    Reads only :data:`READ_FIELDS`. The call on each rank then takes, with B = 1:
    q, k ``[1, T_local, Hk, K]``, v ``[1, T_local, Hv, V]``, g, beta ``[1, T_local, Hv]``
    (its slice of the packed tokens; ``T_local >= cu_seqlens[-1]``), and the local
    offsets replace the call's ``cu_seqlens`` / ``cu_seqlens_cpu`` (as in FLA).
    States are per *local* sequence, ``[N_local, Hv, K, V]``:

    * ``initial_state[i]`` is read for the local sequences that start on this rank; for
      the first local sequence of a rank with ``pre_num_ranks > 0`` it is ignored (the
      state comes from the earlier ranks) and its gradient is zero. So a sequence's
      initial state lives on the rank holding its start.
    * ``final_state[i]`` is the state after the sequence's last local token: its true
      final state on the rank holding its end; for the last local sequence of a rank
      with ``post_num_ranks > 0``, the state handed to the next rank (differentiable:
      a loss on it gets the right gradients).

    Raises:
        TypeError: not a context (no ``group`` field), or a field of the wrong type.
        ValueError: ``group`` None or not joined, ``cu_seqlens`` missing or malformed,
            ``cu_seqlens_cpu`` not a host copy of its length, rank counts out of range
            or contradicting ``is_first_rank`` / ``is_last_rank``.
        NotImplementedError: ``layout="zigzag"``.
        Each names the field, as ``cp_context.<field>``.
    """
    if not hasattr(cp_context, "group"):
        raise TypeError(f"cp_context: expected FLA's FLACPContext (or "
                        f"flash_qla.context_parallel.CPContext), an object with the fields "
                        f"{', '.join(READ_FIELDS)}; got {type(cp_context).__name__}")
    layout = getattr(cp_context, "layout", "contiguous")
    if not isinstance(layout, str):
        raise TypeError(f"cp_context.layout: expected a str, got {type(layout).__name__}")
    if layout == "zigzag":
        raise NotImplementedError("cp_context.layout='zigzag' is not supported (each rank "
                                  "must hold one contiguous slice); build the context with "
                                  "layout='contiguous'")
    if layout != "contiguous":
        raise ValueError(f"cp_context.layout: expected 'contiguous', got {layout!r}")
    group = cp_context.group
    _check_group("cp_context.group", group)
    cu = getattr(cp_context, "cu_seqlens", None)
    if cu is None:
        raise ValueError("cp_context.cu_seqlens: required (the local offsets of this "
                         "rank's sequence pieces), got None")
    check_cu_seqlens_kind("cp_context.cu_seqlens", cu)
    cu_cpu = getattr(cp_context, "cu_seqlens_cpu", None)
    if cu_cpu is not None:
        check_cu_seqlens_kind("cp_context.cu_seqlens_cpu", cu_cpu)
        if cu_cpu.device.type != "cpu" or cu_cpu.numel() != cu.numel():
            raise ValueError(f"cp_context.cu_seqlens_cpu: expected a host copy of "
                             f"cp_context.cu_seqlens ({cu.numel()} entries), got "
                             f"{cu_cpu.numel()} entries on {cu_cpu.device}")
    rank, world = _rank_and_size(group)
    pre = _rank_count(cp_context, "pre_num_ranks", "is_first_rank", rank, "earlier")
    post = _rank_count(cp_context, "post_num_ranks", "is_last_rank", world - 1 - rank, "later")
    return RankLayout(group, rank, world, pre, post, cu, cu_cpu)


def context_for_call(cp_context, *, segment_len, force_intra_cp, traced: bool) -> RankLayout:
    """:func:`resolve_cp_context` for :func:`flash_qla.chunk_gated_delta_rule` (the
    hook in :mod:`flash_qla.api`), also rejecting what does not combine with CP yet:
    a traced call (``torch.compile`` / ``torch.export``) and the segment split
    (``segment_len`` / ``force_intra_cp``), NotImplementedError."""
    if traced:
        raise NotImplementedError("cp_context is not supported inside torch.compile / "
                                  "torch.export; call it eagerly")
    if segment_len is not None or force_intra_cp:
        raise NotImplementedError("cp_context does not combine with the segment split "
                                  "(segment_len / force_intra_cp) yet; pass neither")
    return resolve_cp_context(cp_context)


# --------------------------------------------------------------------------------------
# Communication (the only torch.distributed calls of the package)
# --------------------------------------------------------------------------------------

def _all_gather(x: Tensor, group, world: int) -> Tensor:
    """``[P, *x.shape]``: every rank's ``x`` (same shape and dtype on all ranks), in rank
    order, by one ``all_gather`` of a flat buffer (the form gloo and NCCL both take)."""
    flat = x.contiguous().view(-1)
    out = flat.new_empty(world * flat.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out.view(world, *x.shape)


def _check_headers(headers: list[list[int]]) -> None:
    """The ranks' (pre, post, N, Hv, K, V) agree: one batch, one shape, and the rank
    counts of neighbours consistent. Evaluated on the same gathered data by every rank,
    so every rank raises (none is left waiting in a later collective)."""
    for r, row in enumerate(headers):
        if row[3:] != headers[0][3:]:
            raise ValueError(f"cp_context: every rank must call with the same (Hv, K, V); "
                             f"rank 0 has {tuple(headers[0][3:])}, rank {r} {tuple(row[3:])}")
    for r, (a, b) in enumerate(zip(headers[:-1], headers[1:])):
        a_pre, a_post, a_n, b_pre, b_post, b_n = a[0], a[1], a[2], b[0], b[1], b[2]
        want_pre = a_pre + 1 if a_n == 1 and a_pre > 0 else 1
        want_post = b_post + 1 if b_n == 1 and b_post > 0 else 1
        if (a_post > 0) != (b_pre > 0) or (b_pre and (b_pre, a_post) != (want_pre, want_post)):
            raise ValueError(
                f"cp_context: the ranks' contexts disagree: rank {r} has post_num_ranks="
                f"{a_post} (pre_num_ranks={a_pre}, {a_n} local sequences), rank {r + 1} has "
                f"pre_num_ranks={b_pre} (post_num_ranks={b_post}, {b_n} local sequences); "
                f"build every rank's context from the same global cu_seqlens")


# --------------------------------------------------------------------------------------
# The Kernels wrapper
# --------------------------------------------------------------------------------------

def _piece(xs, bos: int, eos: int) -> list[Tensor]:
    """Tokens ``[bos, eos)`` of packed ``[1, T, ...]`` tensors, contiguous (a view when
    they already are: the whole slice)."""
    return [x[:, bos:eos].contiguous() for x in xs]


def _one_sequence(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(cu_seqlens, cu_seqlens_cpu)`` of a single sequence of ``n`` tokens."""
    cpu = torch.tensor([0, n], dtype=torch.int32)
    return cpu.to(device), cpu


def _with_first(state: Tensor | None, first: Tensor, N: int) -> Tensor:
    """``state`` ``[N, Hv, K, V]`` (zeros when None) with entry 0 replaced by ``first``
    ``[Hv, K, V]`` (a new tensor)."""
    out = first.new_zeros(N, *first.shape) if state is None else state.clone()
    out[0] = first
    return out


def _plus_last(state: Tensor | None, last: Tensor, N: int) -> Tensor:
    """``state`` ``[N, Hv, K, V]`` (zeros when None) plus ``last`` on entry N-1."""
    out = last.new_zeros(N, *last.shape) if state is None else state.clone()
    out[-1] += last
    return out


class CPKernels:
    """A backend's ``Kernels`` (``fwd`` / ``bwd``, :mod:`flash_qla.backend`) for one
    call on one rank of a CP group: same arguments and returns, on this rank's slice,
    with the exchange of the module docstring. Made per call
    (:meth:`RankLayout.kernels`): ``fwd`` keeps the incoming state and the transitions
    of the later ranks for ``bwd``. Every rank of the group must call ``fwd`` (and, when
    training, ``bwd``) the same number of times: each is one collective.

    Attributes:
        inner: the backend's kernels; layout: the :class:`RankLayout`.
        beta_dtype: the inner kernels' (``Kernels.beta_dtype``), or None.
    """

    def __init__(self, inner, layout: RankLayout):
        self.inner, self.layout = inner, layout
        self.beta_dtype = getattr(inner, "beta_dtype", None)
        self._incoming: Tensor | None = None   # [Hv,K,V]: state entering local sequence 0
        self._after: Tensor | None = None      # [post-1,Hv,K,K]: M of ranks r+1 .. r+post-1

    def _transition(self, q, k, v, g, beta, scale: float, K: int) -> Tensor:
        """``M`` ``[Hv, K, K]`` of one sequence (``[1, n, ...]`` tensors): the identity's
        columns run through it with v = 0, V columns per ``fwd`` (gdn-math, "Segment
        transition")."""
        Hv, V = v.shape[2:]
        n = q.shape[1]
        if n == 0:
            return torch.eye(K, dtype=state_dtype(q), device=q.device).expand(Hv, K, K)
        cu, cu_cpu = _one_sequence(n, q.device)
        zero_v = torch.zeros_like(v)
        eye = torch.eye(K, K + V, dtype=state_dtype(q), device=q.device)   # [K,K+V]
        cols = [self.inner.fwd(q, k, zero_v, g, beta, scale=scale,
                               initial_state=eye[:, s:s + V].expand(1, Hv, K, V).contiguous(),
                               cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, output_final_state=True,
                               output_h=False)[4][0]
                for s in range(0, K, V)]                                  # [Hv,K,V] each
        return torch.cat(cols, dim=-1)[..., :K]                           # [Hv,K,K]

    def fwd(self, q, k, v, g, beta, *, scale: float, initial_state, cu_seqlens,
            cu_seqlens_cpu, output_final_state: bool, output_h: bool):
        """``Kernels.fwd`` on this rank's slice (``[1, T_local, ...]``, local offsets),
        from the true incoming state of its first sequence. Returns ``(g_cumsum, A, o,
        h, final_state)`` as the inner ``fwd`` (final_state per local sequence, see
        :func:`resolve_cp_context`). One all-gather of ``Hv * K * (K + V) + 6`` elements
        of the state dtype per rank."""
        lay = self.layout
        bounds = sequence_bounds(cu_seqlens, cu_seqlens_cpu)
        N, (Hv, V), K = len(bounds) - 1, v.shape[2:], q.shape[3]
        receives, sends = lay.pre > 0, lay.post > 0
        through = receives and sends and N == 1          # the slice lies inside a sequence
        common = dict(scale=scale, output_h=output_h)
        L = q.new_zeros(Hv, K, V, dtype=state_dtype(q))
        M = q.new_zeros(Hv, K, K, dtype=state_dtype(q))
        out = None
        if not receives:                                 # the local pass is the final one
            out = self.inner.fwd(q, k, v, g, beta, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                 output_final_state=output_final_state or sends, **common)
            if sends:
                L = out[4][-1]
        elif sends:                                      # the last sequence's piece only
            bos, eos = bounds[-2], bounds[-1]
            piece = _piece((q, k, v, g, beta), bos, eos)
            h0 = None if through or initial_state is None else initial_state[-1:]
            if eos > bos:
                cu, cu_cpu = _one_sequence(eos - bos, q.device)
                L = self.inner.fwd(*piece, scale=scale, initial_state=h0, cu_seqlens=cu,
                                   cu_seqlens_cpu=cu_cpu, output_final_state=True,
                                   output_h=False)[4][0]
            elif h0 is not None:
                L = h0[0]
            if through:
                M = self._transition(*piece, scale, K)
        header = torch.tensor([lay.pre, lay.post, N, Hv, K, V], dtype=L.dtype)
        sent = torch.cat([header.to(L.device), L.reshape(-1), M.reshape(-1)])
        got = _all_gather(sent, lay.group, lay.world_size)     # [P, 6 + Hv*K*(V+K)]
        _check_headers([[int(x) for x in row] for row in got[:, :_HEADER].tolist()])
        L_all = got[:, _HEADER:_HEADER + Hv * K * V].view(-1, Hv, K, V)
        M_all = got[:, _HEADER + Hv * K * V:].view(-1, Hv, K, K)
        r = lay.rank
        if sends:                                        # for the backward
            self._after = M_all[r + 1:r + lay.post].clone()
        if receives:
            S = L_all[r - lay.pre]                       # S = M S + L from S = 0
            for i in range(r - lay.pre + 1, r):
                S = torch.baddbmm(L_all[i], M_all[i], S)                # [Hv,K,V]
            self._incoming = S.clone()
            out = self.inner.fwd(q, k, v, g, beta, initial_state=_with_first(
                                     initial_state, self._incoming, N),
                                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                 output_final_state=output_final_state, **common)
        g_cumsum, A, o, h, final_state = out
        return g_cumsum, A, o, h, (final_state if output_final_state else None)

    def bwd(self, q, k, v, g_cumsum, beta, A, do, *, dht, scale: float, initial_state,
            cu_seqlens, cu_seqlens_cpu):
        """``Kernels.bwd`` on this rank's slice, after this object's ``fwd``: the local
        backward from the incoming state the forward used, with the gradient the later
        ranks hand back added to the last local sequence's ``dht``. Returns ``(dq, dk,
        dv, dbeta, dg, dh0)`` as the inner ``bwd``; ``dh0`` is None without an
        initial state, and zero on entry 0 of a rank with ``pre_num_ranks > 0`` (that
        entry is not read). One all-gather of ``Hv * K * V`` elements per rank."""
        lay = self.layout
        bounds = sequence_bounds(cu_seqlens, cu_seqlens_cpu)
        N, (Hv, V), K = len(bounds) - 1, v.shape[2:], q.shape[3]
        receives, sends = lay.pre > 0, lay.post > 0
        h0 = _with_first(initial_state, self._incoming, N) if receives else initial_state
        B = q.new_zeros(Hv, K, V, dtype=state_dtype(q))
        grads = None
        if receives and not sends:                       # the local pass is the final one
            grads = self.inner.bwd(q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale,
                                   initial_state=h0, cu_seqlens=cu_seqlens,
                                   cu_seqlens_cpu=cu_seqlens_cpu)
            B = grads[5][0]
        elif receives:                                   # the first sequence's piece only
            bos, eos = bounds[0], bounds[1]
            dht0 = None if dht is None else dht[:1]
            if eos > bos:
                cu, cu_cpu = _one_sequence(eos - bos, q.device)
                piece = _piece((q, k, v, g_cumsum, beta, A, do), bos, eos)
                B = self.inner.bwd(*piece, dht=dht0, scale=scale,
                                   initial_state=self._incoming[None], cu_seqlens=cu,
                                   cu_seqlens_cpu=cu_cpu)[5][0]
            elif dht0 is not None:
                B = dht0[0]
        got = _all_gather(B, lay.group, lay.world_size)         # [P,Hv,K,V]
        if sends:
            r = lay.rank
            X = got[r + lay.post]                        # X = M^T X + B from the end
            for i in range(r + lay.post - 1, r, -1):
                X = torch.baddbmm(got[i], self._after[i - r - 1].transpose(-1, -2), X)
            dht = _plus_last(dht, X, N)
        if grads is None:
            grads = self.inner.bwd(q, k, v, g_cumsum, beta, A, do, dht=dht, scale=scale,
                                   initial_state=h0, cu_seqlens=cu_seqlens,
                                   cu_seqlens_cpu=cu_seqlens_cpu)
        dq, dk, dv, dbeta, dg, dh0 = grads
        if initial_state is None:
            dh0 = None
        elif receives:                                   # entry 0 was not read
            dh0 = dh0.clone()
            dh0[0] = 0
        return dq, dk, dv, dbeta, dg, dh0
