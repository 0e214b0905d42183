"""The sm90 backend's host path on the CPU, no GPU: what one call costs in Python and
torch ops before any kernel runs (a development aid for host-time work; the device's own
figures: ``tools/host_cost.py``).

Inputs are ``meta`` tensors (shapes and dtypes only, so torch ops cost their dispatch and
nothing else), every kernel launch of ``flash_qla_tl`` is a counting no-op, the SM count
is fixed (``--sms``), and the call goes through the public ``chunk_gated_delta_rule`` to
:class:`flash_qla_tl.backend.TileLangKernels` built for SM90, as FLA's routed call does
(device-style ``cu_seqlens`` only, ``auto_cp`` on). A ``meta`` tensor has no values: the
one read of the offsets returns the host copy this tool made. Differences from a CUDA
device: a varlen call's chunk layout is built by the host formula (~15 torch ops, once
per offsets tensor, as ``varlen_layout`` caches it) where a device launches one kernel;
pinned-memory copies are plain ones.

Per shape it prints the median host time of a call (forward, inference forward, or
training step = forward + ``torch.autograd.grad``), the kernel launches and aten ops one
call issues, and (``--profile-top``) the Python functions by own time (cProfile). The
device's host CPU is slower than a typical development machine: compare changes here,
not absolute figures with ``host_cost.py``'s.

usage: python tools/host_proxy.py [--shapes 8/16@4x4096,16/32@seqs=...] [--dense-batch]
       [--mode step|fwd|inference] [--iters 200] [--profile-top 0]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmark"))
import common as C  # noqa: E402

#: the modules of ``flash_qla_tl`` whose ``launcher`` (kernel launches) and ``sm_count``
#: (the planner's waves) are replaced, where they have them
_PATCHED = ("forward", "backward", "layout", "recurrent", "backend")

#: the host copy of each meta ``cu_seqlens`` this tool made (id -> CPU tensor)
_HOST_OFFSETS: dict[int, torch.Tensor] = {}


class _Counter(TorchDispatchMode):
    """Counts the aten ops issued while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def install(sms: int) -> collections.Counter:
    """Route ``flash_qla``'s CUDA dispatch to SM90's TileLang kernels with no-op launches
    and a fixed SM count, for tensors on any device; returns the launch counter."""
    import importlib

    import flash_qla.dispatch as dispatch
    import flash_qla.offsets as offsets
    from flash_qla_sm90 import BACKEND
    from flash_qla_sm90.arch import SM90
    from flash_qla_tl import backend

    launches = collections.Counter()

    def launcher(builder, *static):
        name = getattr(builder, "__name__", repr(builder))
        return lambda *args: launches.update([name])

    for name in _PATCHED:
        module = importlib.import_module(f"flash_qla_tl.{name}")
        if hasattr(module, "launcher"):
            module.launcher = launcher
        if hasattr(module, "sm_count"):
            module.sm_count = lambda device: sms
    kernels = backend.TileLangKernels(SM90)
    dispatch.get_kernels = lambda device, **kw: (BACKEND, kernels)
    offsets._copy_to_host = lambda cu: _HOST_OFFSETS[id(cu)]
    return launches


def _inputs(shape: C.Shape, dense: bool):
    """Meta tensors of the benchmark's layout: ``[B, T, ...]`` dense or ``[1, T, ...]``
    with ``cu_seqlens``; grads on."""
    lens = shape.seqlens
    B, T = (len(lens), lens[0]) if dense else (1, sum(lens))
    N, D, bf16 = len(lens), C.HEAD_DIM, torch.bfloat16

    def meta(*size, dtype=bf16):
        return torch.empty(*size, dtype=dtype, device="meta", requires_grad=True)

    x = dict(q=meta(B, T, shape.hk, D), k=meta(B, T, shape.hk, D), v=meta(B, T, shape.hv, D),
             g=meta(B, T, shape.hv, dtype=torch.float32), beta=meta(B, T, shape.hv),
             initial_state=meta(N, shape.hv, D, D, dtype=torch.float32))
    if not dense:
        host = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        x["cu_seqlens"] = host.to("meta")
        _HOST_OFFSETS[id(x["cu_seqlens"])] = host
    return x, torch.empty(B, T, shape.hv, D, dtype=bf16, device="meta")


def _call(mode: str, x: dict, do: torch.Tensor):
    import flash_qla

    def forward():
        return flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)

    if mode == "inference":
        def call():
            with torch.no_grad():
                return forward()
    elif mode == "fwd":
        call = forward
    else:
        wrt = [t for t in x.values() if t.requires_grad]

        def call():
            o, _ = forward()
            return torch.autograd.grad(o, wrt, do)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8/16@4x4096,16/32@seqs=5000+3000+2500+2000+2384+1500",
                    help="comma-separated HK/HV@LAYOUT items (the benchmark's shape keys)")
    ap.add_argument("--dense-batch", action="store_true",
                    help="uniform BxT layouts as dense [B, T] batches (no cu_seqlens)")
    ap.add_argument("--mode", choices=("step", "fwd", "inference"), default="step",
                    help="training step (default), forward with grad, or inference forward")
    ap.add_argument("--iters", type=int, default=200, help="timed calls per shape")
    ap.add_argument("--sms", type=int, default=132, help="SM count the planner sees")
    ap.add_argument("--profile-top", type=int, default=0,
                    help="also list this many Python functions by own time (cProfile)")
    args = ap.parse_args()
    launches = install(args.sms)
    rows = []
    for key in (s.strip() for s in args.shapes.split(",") if s.strip()):
        shape = C.Shape.from_key(f"fwd:{key}")
        dense = args.dense_batch and shape.uniform
        call = _call(args.mode, *_inputs(shape, dense))
        for _ in range(3):                                       # plans, caches
            call()
        launches.clear()
        with _Counter() as counter:
            call()
        one = dict(launches)                                     # one call's launches
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1e6)
        rows.append([shape.label + (" dense" if dense else ""), args.mode,
                     f"{statistics.median(times):.0f}", sum(one.values()),
                     ", ".join(f"{k} {v}" for k, v in sorted(one.items())),
                     sum(counter.ops.values()),
                     ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(6))])
        if args.profile_top:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                call()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile_top)
            print(f"== {rows[-1][0]}: {args.iters} calls\n{out.getvalue()}")
    print(C.format_table(rows, ["shape", "call", "host us", "launches", "kernels",
                                "aten ops", "most issued"]))


if __name__ == "__main__":
    main()
