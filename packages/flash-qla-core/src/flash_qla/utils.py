"""Helpers for packed variable-length batches (``cu_seqlens``), a call cache, and the
names of FlashQLA 0.1.3's ``flash_qla.utils``.

Vocabulary as in :mod:`flash_qla.backend`: N sequences packed along T, described by
``cu_seqlens`` ``[N+1]`` (int32/int64, ``cu_seqlens[0] == 0``, non-decreasing); C is
the chunk size. Sequence ``n`` covers tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` and is
cut into ``ceil(len_n / C)`` chunks (a zero-length sequence has no chunk).

The ``prepare_*`` functions read ``cu_seqlens`` values, so the ones returning host
integers synchronise with the device; they are wrapped in :func:`tensor_cache` so
that the many stages of one call, all passing the same ``cu_seqlens`` object,
compute them once.

FlashQLA 0.1.3 (the earlier ``flash-qla`` on PyPI, same import name) exported from
``flash_qla.utils``: ``l2norm``, ``l2norm_fwd``, ``l2norm_bwd``, ``pack``, ``unpack``,
``pad_and_reshape``, ``fill_last_chunk_of_g``, ``prepare_chunk_indices``,
``prepare_chunk_offsets``, ``tensor_cache``, ``input_guard``. All are here with its
signatures, shapes and dtypes; where a result differs the function's docstring says
so. Names of its submodules that are not provided (``prepare_varlen_metadata``,
``L2NormFunction``, the submodules ``index``, ``math``, ``contiguous`` themselves)
raise an ImportError naming the replacement, also on attribute access (so
``hasattr`` raises for them instead of returning False).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as nnf

from flash_qla import validation
from flash_qla.offsets import version_of as _version_of

__all__ = [
    "fill_last_chunk_of_g",
    "input_guard",
    "l2norm",
    "l2norm_bwd",
    "l2norm_fwd",
    "pack",
    "pad_and_reshape",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "prepare_lens",
    "tensor_cache",
    "unpack",
]

F = TypeVar("F", bound=Callable[..., Any])


def _same_argument(a: Any, b: Any, b_version: int | None) -> bool:
    """Tensors match by identity and version (an in-place edit misses); others by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b and _version_of(a) == b_version
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # e.g. lists of tensors: no truth value
        return False


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without the call when x already has that dtype: a no-op ``to``
    still costs a dispatch (~10 us of host time per call on the GPU hosts,
    docs/perf-notes.md), and the host path makes several per training step."""
    return x if x.dtype == dtype else x.to(dtype)


def tensor_cache(fn: F) -> F:
    """Cache the most recent call of ``fn``, keyed on the identity of its tensors.

    A call whose arguments are the very same tensor objects as the previous call
    (``is``, not value equality; and not modified in place since) and equal
    non-tensor arguments returns the previous result without calling ``fn``.
    Anything else calls ``fn`` and replaces the cached entry: one entry is kept.
    The cache holds strong references to the last arguments and result, so a
    cached tensor cannot be freed and its ``id`` reused while it is the key.
    (FlashQLA 0.1.3's decorator of this name kept four entries, asserted a CUDA device
    and failed on a miss inside a CUDA-graph capture; results are the same, only how
    often ``fn`` runs differs.)

    >>> calls = []
    >>> @tensor_cache
    ... def total(x):
    ...     calls.append(1)
    ...     return int(x.sum())
    >>> a = torch.tensor([1, 2, 3])
    >>> total(a), total(a), len(calls)          # second call is a hit
    (6, 6, 1)
    >>> total(a.clone()), len(calls)            # equal values, other object: miss
    (6, 2)
    """
    # The last call: its positional and keyword arguments, each with the version
    # counter it had then (None for non-tensors), and its result.
    last: tuple[tuple, dict, Any] | None = None

    def versioned(value: Any) -> tuple[Any, int | None]:
        return value, _version_of(value) if isinstance(value, torch.Tensor) else None

    def is_hit(args: tuple, kwargs: dict) -> bool:
        if last is None:
            return False
        last_args, last_kwargs, _ = last
        return (
            len(args) == len(last_args)
            and kwargs.keys() == last_kwargs.keys()
            and all(_same_argument(a, *b) for a, b in zip(args, last_args))
            and all(_same_argument(kwargs[n], *last_kwargs[n]) for n in kwargs)
        )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal last
        if is_hit(args, kwargs):
            return last[2]
        result = fn(*args, **kwargs)
        last = (
            tuple(versioned(a) for a in args),
            {n: versioned(v) for n, v in kwargs.items()},
            result,
        )
        return result

    return wrapper  # type: ignore[return-value]


@tensor_cache
def prepare_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence lengths ``[N]`` from ``cu_seqlens`` ``[N+1]`` (same dtype and device).

    >>> prepare_lens(torch.tensor([0, 3, 3, 10]))
    tensor([3, 0, 7])
    """
    return cu_seqlens[1:] - cu_seqlens[:-1]  # [N]


def _chunks_per_sequence(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``ceil(len_n / C)`` for every sequence, int64 ``[N]``."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    lens = prepare_lens(cu_seqlens).long()  # [N]
    return (lens + chunk_size - 1) // chunk_size  # [N]


@tensor_cache
def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """One row per chunk of the packed batch: (sequence index, chunk index in it).

    Returns ``[NT, 2]`` in ``cu_seqlens``' dtype and on its device, chunks in packed
    order (FLA's convention). Zero-length sequences contribute no row, and the
    sequence index stays correct after them (as FLA 0.6.0; FlashQLA 0.1.3 counted only
    the non-empty sequences there, so after an empty one its index named the wrong
    sequence; without empty sequences the two agree). Synchronises with the device.

    >>> prepare_chunk_indices(torch.tensor([0, 3, 3, 10]), 4).tolist()
    [[0, 0], [2, 0], [2, 1]]
    """
    per_seq = _chunks_per_sequence(cu_seqlens, chunk_size)  # [N]
    n_seq = per_seq.numel()
    seq_idx = torch.repeat_interleave(
        torch.arange(n_seq, device=cu_seqlens.device), per_seq
    )  # [NT]
    first_chunk = torch.cumsum(per_seq, 0) - per_seq  # [N], exclusive prefix sum
    chunk_idx = torch.arange(seq_idx.numel(), device=cu_seqlens.device) - first_chunk[seq_idx]
    return torch.stack([seq_idx, chunk_idx], dim=1).to(cu_seqlens.dtype)  # [NT, 2]


@tensor_cache
def prepare_chunk_offsets(
    cu_seqlens: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, int]:
    """Index of every sequence's first chunk, and the total number of chunks.

    Returns ``(chunk_offsets, NT)``: ``chunk_offsets`` ``[N+1]`` in ``cu_seqlens``'
    dtype and on its device (as FlashQLA 0.1.3) with ``chunk_offsets[0] == 0`` and
    ``chunk_offsets[n+1] - chunk_offsets[n] == ceil(len_n / C)``; ``NT`` a Python
    int (reading it synchronises with the device).

    >>> offsets, total = prepare_chunk_offsets(torch.tensor([0, 3, 3, 10]), 4)
    >>> offsets.tolist(), total
    ([0, 1, 1, 3], 3)
    """
    per_seq = _chunks_per_sequence(cu_seqlens, chunk_size)  # [N]
    offsets = torch.cat([per_seq.new_zeros(1), torch.cumsum(per_seq, 0)])  # [N+1] int64
    return offsets.to(cu_seqlens.dtype), int(offsets[-1])


# --------------------------------------------------------------------------------------
# Packed <-> padded layouts (FlashQLA 0.1.3's pack / unpack / pad_and_reshape)
# --------------------------------------------------------------------------------------

def _host_bounds(cu_seqlens: object) -> list[int]:
    """``cu_seqlens`` checked (1-D int, starts at 0, non-decreasing) as host ints."""
    validation.check_cu_seqlens_kind("cu_seqlens", cu_seqlens)
    bounds = [int(b) for b in cu_seqlens.tolist()]               # one sync on a GPU
    validation.check_cu_seqlens_values("cu_seqlens", bounds, bounds[-1])
    return bounds


def _token_coordinates(bounds: list[int],
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed token ``t < bounds[-1]``: its sequence and its position there,
    two int64 ``[bounds[-1]]`` tensors on ``device``."""
    starts = torch.tensor(bounds[:-1], dtype=torch.long)                     # [N]
    lens = torch.tensor(bounds[1:], dtype=torch.long) - starts               # [N]
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)             # [Tt]
    pos = torch.arange(bounds[-1]) - starts[seq]                             # [Tt]
    return seq.to(device), pos.to(device)


def _check_padded(name: str, x: object, min_dim: int, layout: str) -> None:
    validation.check_is_tensor(name, x)
    if x.dim() < min_dim:
        raise ValueError(f"{name} must be at least {min_dim}-D {layout}; got {x.dim()}-D "
                         f"shape {list(x.shape)}")


def pack(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Padded rows to one packed row: ``[N, L, ...]`` -> ``[1, cu_seqlens[-1], ...]``.

    Row ``n`` of ``x`` holds sequence ``n`` in its first ``len_n`` positions (the rest
    is ignored); the result holds them one after the other, as :func:`unpack` reads
    them. Any trailing dims (heads, head dim, or ``[Hv, K, V]`` states when
    ``cu_seqlens`` are chunk offsets). Same dtype and device as ``x``;
    differentiable. Reads ``cu_seqlens`` on the host (one sync on a GPU).

    Raises:
        TypeError: x not a tensor, or cu_seqlens not an int32/int64 tensor.
        ValueError: x below 2-D, ``x.shape[0] != N``, a sequence longer than ``L``,
            or ``cu_seqlens`` not starting at 0 / decreasing.

    >>> pack(torch.tensor([[1, 2, 0], [3, 4, 5]]), torch.tensor([0, 2, 5])).tolist()
    [[1, 2, 3, 4, 5]]
    """
    _check_padded("x", x, 2, "[N, L, ...]")
    bounds = _host_bounds(cu_seqlens)
    N = len(bounds) - 1
    if x.shape[0] != N:
        raise ValueError(f"x must have one row per sequence, N={N} (len(cu_seqlens) - 1); "
                         f"got x.shape[0]={x.shape[0]}")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if longest > x.shape[1]:
        raise ValueError(f"x must have at least the longest sequence's {longest} positions "
                         f"per row; got x.shape[1]={x.shape[1]}")
    seq, pos = _token_coordinates(bounds, x.device)                          # [Tt]
    return x[seq, pos].unsqueeze(0)                                          # [1,Tt,...]


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """One packed row to zero-padded rows: ``[1, T, ...]`` -> ``[N, max_n len_n, ...]``.

    The inverse of :func:`pack`: row ``n`` of the result holds tokens
    ``cu_seqlens[n]:cu_seqlens[n+1]`` of ``x`` then zeros; tokens after
    ``cu_seqlens[-1]`` (padding) are dropped. Same dtype and device as ``x``;
    differentiable. Reads ``cu_seqlens`` on the host (one sync on a GPU).

    Raises:
        TypeError: x not a tensor, or cu_seqlens not an int32/int64 tensor.
        ValueError: x below 2-D, ``x.shape[0] != 1``, ``cu_seqlens[-1] > T``, or
            ``cu_seqlens`` not starting at 0 / decreasing.

    >>> unpack(torch.tensor([[1, 2, 3, 4, 5, 9]]), torch.tensor([0, 2, 5])).tolist()
    [[1, 2, 0], [3, 4, 5]]
    """
    _check_padded("x", x, 2, "[1, T, ...]")
    if x.shape[0] != 1:
        raise ValueError(f"x must be one packed row [1, T, ...]; got x.shape[0]={x.shape[0]}")
    bounds = _host_bounds(cu_seqlens)
    validation.check_cu_seqlens_values("cu_seqlens", bounds, x.shape[1])
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    seq, pos = _token_coordinates(bounds, x.device)                          # [Tt]
    out = x.new_zeros(len(bounds) - 1, longest, *x.shape[2:])                # [N,L,...]
    return out.index_put((seq, pos), x[0, :bounds[-1]])


def _check_chunk_size(chunk_size: object) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int; got {type(chunk_size).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    return int(chunk_size)


def pad_and_reshape(x: torch.Tensor, dim: int, chunk_size: int = 64) -> torch.Tensor:
    """Cut dim ``dim`` of ``x`` into chunks: ``[..., L, ...]`` -> ``[..., ceil(L / C), C, ...]``.

    The dim is first zero-padded at its end to a multiple of ``C = chunk_size``; the
    other dims are unchanged. Always a new tensor (never a view of ``x``), same dtype
    and device; differentiable. ``dim`` may be negative (FlashQLA 0.1.3 took only
    ``dim >= 0``) and ``L = 0`` gives zero chunks.

    Raises:
        TypeError: x not a tensor, dim or chunk_size not an int.
        ValueError: dim out of range, chunk_size <= 0.

    >>> pad_and_reshape(torch.arange(5), 0, chunk_size=2).tolist()
    [[0, 1], [2, 3], [4, 0]]
    """
    validation.check_is_tensor("x", x)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int; got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [-{x.dim()}, {x.dim()}) for x of shape "
                         f"{list(x.shape)}; got {dim}")
    C = _check_chunk_size(chunk_size)
    d = dim % x.dim()
    n_chunks = -(-x.shape[d] // C)
    pad = n_chunks * C - x.shape[d]
    # nnf.pad lists (left, right) per dim from the last one backwards
    padded = nnf.pad(x, [0, 0] * (x.dim() - 1 - d) + [0, pad])               # copies
    return padded.reshape(*x.shape[:d], n_chunks, C, *x.shape[d + 1:])


def fill_last_chunk_of_g(
    g: torch.Tensor,
    num_tokens: int,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int = 64,
    reverse: bool = False,
) -> torch.Tensor:
    """In place, the rows past a sequence's end in its last, partial chunk of ``g``.

    ``g`` is chunked as :func:`pad_and_reshape` (``dim=1``) leaves it,
    ``[B, NC, C, ...]``: one row per dense sequence of ``num_tokens`` tokens
    (``cu_seqlens`` None, ``NC = ceil(num_tokens / C)``), or per packed sequence after
    :func:`unpack` (``cu_seqlens`` given, ``B = N``; ``num_tokens`` unused). In a
    sequence whose length ``L`` is not a multiple of ``C``, with ``r = L % C`` valid
    rows in its last chunk ``L // C``:

    * ``reverse=False``: rows ``r..C-1`` of that chunk take row ``r-1``'s value (the
      chunk-local gate cumsum held constant past the end, as if the missing tokens had
      ``g = 0``);
    * ``reverse=True``: row ``C-1``'s value is added to row ``r-1`` (folding back what
      a gradient put on the last row of the chunk).

    Returns ``g`` itself (modified; FlashQLA 0.1.3's helper for its reference code).
    Reads ``cu_seqlens`` on the host (one sync on a GPU).

    Raises:
        TypeError / ValueError: g below 3-D, ``g.shape[2] != chunk_size``, ``NC`` not
            ``ceil(num_tokens / C)`` (dense), or ``B`` not ``N`` / too few chunks
            (packed).

    >>> fill_last_chunk_of_g(torch.tensor([[[1., 2., 0., 0.]]]), 2, None, 4).tolist()
    [[[1.0, 2.0, 2.0, 2.0]]]
    """
    _check_padded("g", g, 3, "[B, NC, C, ...]")
    C = _check_chunk_size(chunk_size)
    validation.check_bool("reverse", reverse)
    if g.shape[2] != C:
        raise ValueError(f"g must be chunked [B, NC, C={C}, ...]; got g.shape[2]={g.shape[2]}")
    if cu_seqlens is None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
            raise TypeError(f"num_tokens must be an int; got {type(num_tokens).__name__}")
        if g.shape[1] != -(-num_tokens // C):
            raise ValueError(f"g must have ceil(num_tokens / C) = {-(-num_tokens // C)} "
                             f"chunks for num_tokens={num_tokens}; got {g.shape[1]}")
        rows = [(slice(None), num_tokens)]                 # every batch row, one length
    else:
        bounds = _host_bounds(cu_seqlens)
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        if g.shape[0] != len(lens) or g.shape[1] < -(-max(lens) // C):
            raise ValueError(f"g must be [N={len(lens)}, NC >= {-(-max(lens) // C)}, C, ...] "
                             f"(unpacked); got shape {list(g.shape)}")
        rows = list(enumerate(lens))
    with torch.no_grad():
        for row, length in rows:
            last, r = divmod(length, C)
            if r == 0:
                continue
            if reverse:
                g[row, last, r - 1] += g[row, last, C - 1]
            else:
                g[row, last, r:] = g[row, last, r - 1:r]
    return g


# --------------------------------------------------------------------------------------
# L2 norm over the last dim (FlashQLA 0.1.3's l2norm / l2norm_fwd / l2norm_bwd)
# --------------------------------------------------------------------------------------

def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 when any tensor is fp64, else fp32."""
    return torch.float64 if validation.uses_float64(*tensors) else torch.float32


def _check_norm_args(x: object, eps: object, dim: object, name: str = "x") -> None:
    validation.check_is_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must be at least 1-D [..., D]; got a 0-D tensor")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a float >= 0; got {type(eps).__name__} {eps!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be a float >= 0; got {eps!r}")
    if dim not in (-1, x.dim() - 1) or isinstance(dim, bool):
        raise ValueError(f"dim must be the last dim (-1 or {x.dim() - 1}); got {dim!r}")


def l2norm_fwd(x: torch.Tensor, eps: float = 1e-6,
               dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise the last dim: ``y = x * rstd``, ``rstd = 1 / sqrt(sum(x^2) + eps)``.

    x ``[..., D]`` any floating dtype. Computed in fp32 (fp64 for fp64 x). Returns
    ``(y, rstd)``: y ``[..., D]`` in x's dtype, rstd ``[...]`` (x's shape without its
    last dim) fp32 (fp64 for fp64 x; FlashQLA 0.1.3 computed fp64 inputs in fp32).
    ``dim`` must name the last dim (FlashQLA 0.1.3's restriction). Differentiable
    through autograd, though :func:`l2norm` is the differentiable entry point. The
    same formula as ``chunk_gated_delta_rule``'s ``use_qk_l2norm_in_kernel``.

    Raises:
        TypeError: x not a floating tensor, eps not a float.  ValueError: eps < 0, dim
            not the last.

    >>> y, rstd = l2norm_fwd(torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16), eps=0.0)
    >>> y.dtype, y.float().tolist(), rstd.dtype, rstd.shape
    (torch.bfloat16, [[0.6015625, 0.80078125]], torch.float32, torch.Size([1]))
    """
    _check_norm_args(x, eps, dim)
    xw = x.to(_work_dtype(x))                                                # [...,D]
    rstd = torch.rsqrt(xw.square().sum(-1) + eps)                            # [...]
    return (xw * rstd.unsqueeze(-1)).to(x.dtype), rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, eps: float = 1e-6,
               dim: int = -1) -> torch.Tensor:
    """Gradient of :func:`l2norm_fwd`: ``dx = rstd * (dy - (dy . y) y)`` per row.

    ``y`` ``[..., D]`` and ``rstd`` ``[...]`` as :func:`l2norm_fwd` returned them (a
    trailing size-1 dim on rstd is accepted), ``dy`` ``[..., D]`` the gradient of y.
    Argument order and ``eps`` (unused: rstd already holds it) as FlashQLA 0.1.3.
    Returns dx ``[..., D]`` in fp32 (fp64 when an input is fp64), not in x's dtype, as
    FlashQLA 0.1.3: cast it yourself.

    Raises:
        TypeError: a non-floating input.  ValueError: dy's shape not y's, rstd not
            ``y.shape[:-1]``, eps < 0, dim not the last.
    """
    _check_norm_args(y, eps, dim, "y")
    _check_norm_args(dy, eps, dim, "dy")
    validation.check_is_tensor("rstd", rstd)
    if dy.shape != y.shape:
        raise ValueError(f"dy must have y's shape {list(y.shape)}; got {list(dy.shape)}")
    if tuple(rstd.shape) not in (tuple(y.shape[:-1]), (*y.shape[:-1], 1)):
        raise ValueError(f"rstd must have shape {list(y.shape[:-1])} (y's without its last "
                         f"dim); got {list(rstd.shape)}")
    work = _work_dtype(y, rstd, dy)
    yw, dyw = y.to(work), dy.to(work)                                        # [...,D]
    r = rstd.to(work).reshape(*y.shape[:-1], 1)                              # [...,1]
    return (dyw - (dyw * yw).sum(-1, keepdim=True) * yw) * r


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last dim, differentiable.

    x ``[..., D]`` any floating dtype; computed in fp32 (fp64 for fp64 x) and returned
    in x's dtype and shape (:func:`l2norm_fwd`'s y). Its gradient comes from autograd
    through the fp32 computation, returned in x's dtype (the value of
    :func:`l2norm_bwd`, there computed from the rounded y).

    Raises:
        TypeError: x not a floating tensor, eps not a float.  ValueError: eps < 0.

    >>> [round(v, 6) for v in l2norm(torch.tensor([3.0, 4.0]), eps=0.0).tolist()]
    [0.6, 0.8]
    """
    return l2norm_fwd(x, eps)[0]


# --------------------------------------------------------------------------------------
# input_guard (FlashQLA 0.1.3's decorator)
# --------------------------------------------------------------------------------------

def input_guard(fn: F) -> F:
    """Decorator: call ``fn`` with its tensor arguments made contiguous, and with the
    CUDA device of its first tensor argument current.

    Positional and keyword tensor arguments are replaced by ``x.contiguous()`` (the
    same object where it already is); other arguments pass unchanged. The first
    tensor (positional ones first) picks the device: for a CUDA tensor the call runs
    under ``torch.cuda.device(x.device)``, for others (CPU) nothing is set.

    >>> @input_guard
    ... def strides(x):
    ...     return x.stride()
    >>> strides(torch.zeros(2, 3).t())
    (2, 1)
    """
    def contiguous(value: Any) -> Any:
        return value.contiguous() if isinstance(value, torch.Tensor) else value

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(contiguous(a) for a in args)
        kwargs = {n: contiguous(v) for n, v in kwargs.items()}
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)),
                     None)
        if first is not None and first.device.type == "cuda":
            with torch.cuda.device(first.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# FlashQLA 0.1.3 names not provided: an ImportError that names the replacement
# --------------------------------------------------------------------------------------

_SUBMODULE = ("flash_qla.utils is one module here (FlashQLA 0.1.3's submodule "
              "flash_qla.utils.{name} does not exist): import the names from flash_qla.utils "
              "directly, e.g. `from flash_qla.utils import prepare_chunk_offsets, l2norm`")

#: name -> why it is not provided and what to use instead.
NOT_PROVIDED = {
    "prepare_varlen_metadata": (
        "flash_qla.utils.prepare_varlen_metadata (FlashQLA 0.1.3: attach host-computed "
        "chunk metadata to cu_seqlens) is not provided: pass the host copy of the offsets "
        "instead, chunk_gated_delta_rule(..., cu_seqlens=cu_seqlens, "
        "cu_seqlens_cpu=cu_seqlens_cpu), which plans without a host sync"),
    "L2NormFunction": (
        "flash_qla.utils.L2NormFunction (FlashQLA 0.1.3's autograd Function) is not "
        "provided: use flash_qla.utils.l2norm(x, eps), differentiable, or the pair "
        "l2norm_fwd / l2norm_bwd"),
    "l2norm_fwd_compiled": (
        "flash_qla.utils.l2norm_fwd_compiled (FlashQLA 0.1.3's torch.compile'd kernel) "
        "is not provided: use flash_qla.utils.l2norm_fwd(x, eps)"),
    "l2norm_bwd_compiled": (
        "flash_qla.utils.l2norm_bwd_compiled (FlashQLA 0.1.3's torch.compile'd kernel) "
        "is not provided: use flash_qla.utils.l2norm_bwd(y, rstd, dy)"),
    **{name: _SUBMODULE.format(name=name) for name in ("index", "math", "contiguous")},
}


def __getattr__(name: str) -> Any:
    """Module attribute hook: the FlashQLA 0.1.3 names in :data:`NOT_PROVIDED` raise an
    ImportError (so ``from flash_qla.utils import X`` shows the message)."""
    if name in NOT_PROVIDED:
        raise ImportError(NOT_PROVIDED[name], name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
