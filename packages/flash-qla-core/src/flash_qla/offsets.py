"""Host copies of ``cu_seqlens``: one device-to-host read per offsets tensor.

FLA calls ``flash_qla.chunk_gated_delta_rule`` with ``cu_seqlens`` on the device and no
``cu_seqlens_cpu``. Planning a call (the segment split, the backward's kernel choice,
output sizes) needs the offsets on the host, and validating them reads them anyway, so
:func:`host_offsets` reads them once and the whole call, forward and backward, uses that
copy. A model calls every layer with the same offsets tensor, so the copy is kept per
tensor object (and its in-place version counter): the other layers and the backward
read no more.

Inference tensors (made under ``torch.inference_mode``) have no version counter, so an
in-place rewrite of one (an engine refilling a static buffer) could not be told from an
unchanged tensor: their copy is never kept (one read per call). Nothing is read during
a CUDA-graph capture (a read would end the capture): there the call plans without host
offsets.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

__all__ = ["KeptPlans", "bounds", "clear_cache", "clear_plans", "host_offsets", "kept_offsets",
           "read_offsets"]

#: How many offsets tensors keep their host copy (most recent first out last).
CACHE_SIZE = 16

# id(device tensor) -> (weak reference to it, its version when read, its data_ptr, host copy)
_copies: OrderedDict[int, tuple[weakref.ref, int, int, torch.Tensor]] = OrderedDict()


def version_of(t: torch.Tensor) -> int | None:
    """The in-place version counter; None for inference tensors, which have none."""
    try:
        return t._version
    except RuntimeError:
        return None


def read_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` ``[N+1]`` copied to the host (same dtype), one read per tensor.

    A tensor already read, not modified in place since (same object, version counter
    and storage), returns the same host tensor without touching the device. A host
    ``cu_seqlens`` is returned as it is. Never call it during a CUDA-graph capture.
    """
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens
    return _kept_copy(cu_seqlens)


def bounds(cu_seqlens: torch.Tensor | None,
           cu_seqlens_cpu: torch.Tensor | None) -> list[int] | None:
    """The offsets ``[N+1]`` as Python ints: from ``cu_seqlens_cpu`` when given, else
    :func:`read_offsets` of ``cu_seqlens`` (one read per tensor); None when neither is
    given (a dense call)."""
    if cu_seqlens_cpu is not None:
        return cu_seqlens_cpu.tolist()
    return None if cu_seqlens is None else read_offsets(cu_seqlens).tolist()


def _copy_to_host(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens.to("cpu")                                  # the one sync


def _kept(cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """The host copy kept of this very tensor (same object, version and storage), or
    None; inference tensors (no version counter) are never kept."""
    kept = _copies.get(id(cu_seqlens))
    version = version_of(cu_seqlens)
    if (kept is None or version is None or kept[0]() is not cu_seqlens or kept[1] != version
            or kept[2] != cu_seqlens.data_ptr()):
        return None
    _copies.move_to_end(id(cu_seqlens))
    return kept[3]


def _kept_copy(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """:func:`_copy_to_host` of ``cu_seqlens``, kept per (object, version, storage)."""
    host = _kept(cu_seqlens)
    if host is not None:
        return host
    host = _copy_to_host(cu_seqlens)
    version = version_of(cu_seqlens)
    if version is not None:
        _copies[id(cu_seqlens)] = (weakref.ref(cu_seqlens), version, cu_seqlens.data_ptr(),
                                   host)
        _copies.move_to_end(id(cu_seqlens))
        while len(_copies) > CACHE_SIZE:
            _copies.popitem(last=False)
    return host


def kept_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """The host copy :func:`read_offsets` kept of this very tensor (same object, version
    and storage), or None; never reads the device, so it may be asked during a capture
    (a heuristic's input there, e.g. the split's segment length, never a size)."""
    return cu_seqlens if cu_seqlens.device.type == "cpu" else _kept(cu_seqlens)


def host_offsets(cu_seqlens: torch.Tensor | None,
                 cu_seqlens_cpu: torch.Tensor | None) -> torch.Tensor | None:
    """The host offsets a call plans with: ``cu_seqlens_cpu`` when given; None for a
    dense call (no ``cu_seqlens``) or during a CUDA-graph capture on ``cu_seqlens``'
    device; else :func:`read_offsets` of ``cu_seqlens``. ``cu_seqlens`` must already be
    a valid offsets tensor (``validation.check_cu_seqlens_kind``)."""
    if cu_seqlens_cpu is not None or cu_seqlens is None:
        return cu_seqlens_cpu
    if cu_seqlens.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return read_offsets(cu_seqlens)


#: Every :class:`KeptPlans` (the API's call plans, a backend's launch plans), for
#: :func:`clear_plans`.
_every_plans: weakref.WeakSet = weakref.WeakSet()


def clear_plans() -> None:
    """Forget every plan kept by any :class:`KeptPlans` (``flash_qla.dispatch.clear_cache``:
    a call plan holds the kernels it picked)."""
    for plans in list(_every_plans):
        plans.clear()


class KeptPlans:
    """Plans of calls kept per signature and offsets tensors, the ``size`` most recent.

    A plan (checks passed, kernels chosen, a split or launch layout planned) depends on
    a call's static signature and on the values of its offsets tensors (``cu_seqlens``,
    the host copy). The key holds the signature and each offsets tensor's id and in-place
    version (:meth:`key`), and an entry keeps weak references to the tensors it was made
    with: an id reused by a later tensor, once the first is freed, finds an entry whose
    reference is dead and misses."""

    def __init__(self, size: int):
        self.size = size
        self._plans: OrderedDict[tuple, tuple[tuple, object]] = OrderedDict()
        _every_plans.add(self)

    @staticmethod
    def key(signature: tuple, tensors: tuple) -> tuple | None:
        """``signature`` with ``(id, version)`` of each tensor of ``tensors`` (None where
        absent); None where one has no version counter (an inference tensor: an in-place
        rewrite would go unseen) or is not a plain tensor (the call's checks say what)."""
        key = [signature]
        for x in tensors:
            version = version_of(x) if type(x) is torch.Tensor else None
            if x is not None and version is None:
                return None
            key.append(None if x is None else (id(x), version))
        return tuple(key)

    def get(self, key: tuple | None, tensors: tuple):
        """The plan kept for ``key`` if made with these very ``tensors``, else None."""
        if key is None:
            return None
        try:
            kept = self._plans.get(key)
        except TypeError:                # an unhashable argument: the call's checks say
            return None
        if kept is None or not all(ref() is x for ref, x in zip(kept[0], tensors)):
            return None
        try:
            self._plans.move_to_end(key)
        except KeyError:                 # dropped by another thread meanwhile: still valid
            pass
        return kept[1]

    def keep(self, key: tuple | None, tensors: tuple, plan) -> None:
        """Keep ``plan`` under ``key`` (nothing when None), made with ``tensors``."""
        if key is None:
            return
        refs = tuple(_none if x is None else weakref.ref(x) for x in tensors)
        self._plans[key] = (refs, plan)
        self._plans.move_to_end(key)
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()


def _none() -> None:
    """The "weak reference" of an absent tensor: None, as the tensor itself."""
    return None


def clear_cache() -> None:
    """Forget every kept host copy (tests; memory is small: N+1 integers per entry)."""
    _copies.clear()
