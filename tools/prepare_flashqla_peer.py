#!/usr/bin/env python3
"""Compile the peer FlashQLA 0.1.3's TileLang kernels ahead of time, on a machine
without a GPU, into a TileLang cache directory that the H200 then hits (no JIT there).

Why this works: TileLang keys a cached kernel on the PrimFunc text, the resolved target,
pass configs, compile flags, its version and the CPU architecture, not on the GPU
(../shared/docs/tilelang-notes.md). FlashQLA's ``@tilelang.jit`` kernels use the default
target ``"auto"``, which on an H200 resolves to ``Target({"kind": "cuda", "arch":
"sm_90a"})``; here TILELANG_DEFAULT_TARGET names that same target explicitly, so the keys
agree.

Which kernels: FlashQLA specialises every kernel on the head counts and picks variants
at run time (tile width from the SM count, intra-card context parallelism from the
sequence lengths, train or inference). Rather than re-implementing those choices, this
script runs FlashQLA's own ``chunk_gated_delta_rule`` (and its backward) on meta tensors
for each benchmark shape, with every kernel launch replaced by a recorder, then compiles
each distinct (kernel, specialisation) once. Only the host-side choices run; they read
the SM count, set here to the H200's 132 (--sms).

To get through FlashQLA's import and host code without a GPU, this process (only)
pretends a CUDA device: ``torch.cuda.get_device_properties`` returns the SM count,
``get_target_compute_version`` sees an sm_90a target, ``torch.cuda.is_available`` is
true during the trace, and FlashQLA's ``_create_cu_seqlens`` (which allocates on
``cuda:N``) builds its tensor on the CPU. FlashQLA's files are not modified.

Usage (CPU machine, TileLang 0.1.15 + nvcc; repo root):
  python3 tools/prepare_flashqla_peer.py --flashqla-path PEER_DIR --cache-dir DIR \
      [--heads 2/8,16/16] [--layouts 1x8192,varlen-a] [--modes fwd,bwd] [--dense-batch]
      [--sms 132] [--list]
PEER_DIR is the unpacked wheel (the folder holding flash_qla/, as given to the benchmark
with --flashqla-path). --heads and --layouts default to the benchmark grid of each mode
(benchmark/common.py); --list prints the kernel variants without compiling. Cost here
(2 cores): ~10-20 s per variant, ~95 s per head pair over the 9 forward layouts; the
whole forward grid is 73 variants (~12 min), the backward grid 71 (~11 min), ~1.9 MB
as tar.xz together. Pack DIR like .offline-gpu/tilelang-cache (tar without
*/cuda-binaries and */.staging; or compile into that same cache before it is packed) and
let TILELANG_CACHE_DIR point at a writable copy on the device, with TileLang 0.1.15 there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = {"kind": "cuda", "arch": "sm_90a"}  # what "auto" resolves to on an H200
HEAD_DIM = 128


def _benchmark_grid():
    sys.path.insert(0, os.path.join(REPO, "benchmark"))
    import common  # stdlib-only at import time

    return common


@contextlib.contextmanager
def _pretend_gpu(torch, sms: int):
    """Fake just enough of torch.cuda for FlashQLA's host code (see the module doc)."""
    saved = {n: getattr(torch.cuda, n) for n in
             ("get_device_properties", "is_available", "is_current_stream_capturing", "device")}
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=sms, name="NVIDIA H200")
    torch.cuda.is_available = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


def import_peer(path: str, sms: int):
    """Import FlashQLA 0.1.3 from ``path`` as if on an sm_90a GPU with ``sms`` SMs."""
    import tilelang  # noqa: F401  (puts TileLang's tvm on the path)
    import torch
    from tvm.target import Target

    path = os.path.realpath(path)
    sys.path.insert(0, path)
    with _pretend_gpu(torch, sms), Target(TARGET):
        import flash_qla
        from flash_qla.ops.gated_delta_rule import chunk as chunk_mod
    if not os.path.realpath(flash_qla.__file__).startswith(path + os.sep):
        raise SystemExit(f"imported the wrong flash_qla ({flash_qla.__file__})")
    if getattr(flash_qla, "__version__", "?") != "0.1.3":
        print(f"warning: FlashQLA {flash_qla.__version__}, written for 0.1.3", file=sys.stderr)
    return flash_qla, chunk_mod


class Recorder:
    """Replaces ``JITImpl.__call__``: records (kernel, arguments) and returns a launcher
    that does nothing."""

    def __init__(self):
        self.seen: dict = {}

    def __call__(self, jit_impl, *args, **kwargs):
        key = (id(jit_impl), repr(args), repr(sorted(kwargs.items())))
        self.seen.setdefault(key, (jit_impl, args, kwargs))
        return lambda *a, **k: None


def _run_shape(torch, flash_qla, shape, dense_batch: bool) -> None:
    """One benchmark call of FlashQLA (forward, plus backward for ``bwd``) on meta
    tensors, with the benchmark's conventions: q/k/v/beta bf16, g and h0 fp32, int32
    cu_seqlens for packed layouts, final state out, backward from (do, dht)."""
    lens, hk, hv, d = shape.seqlens, shape.hk, shape.hv, HEAD_DIM
    t, n = sum(lens), len(lens)
    dense = n == 1 or (dense_batch and len(set(lens)) == 1)
    b, tt = (n, t // n) if dense else (1, t)
    train = shape.mode == "bwd"

    def mk(*size, dtype=torch.bfloat16):
        x = torch.empty(*size, dtype=dtype, device="meta")
        return x.requires_grad_(train)

    f32 = torch.float32
    q, k, v = mk(b, tt, hk, d), mk(b, tt, hk, d), mk(b, tt, hv, d)
    g, beta, h0 = mk(b, tt, hv, dtype=f32), mk(b, tt, hv), mk(n, hv, d, d, dtype=f32)
    cu = None
    if not dense:
        cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    with torch.set_grad_enabled(train):
        o, ht = flash_qla.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=False, cu_seqlens=cu)
        if train:
            torch.autograd.backward((o, ht), (torch.empty_like(o), torch.empty_like(ht)))


def trace(torch, flash_qla, chunk_mod, shapes, sms: int, dense_batch: bool) -> list:
    """Run FlashQLA's entry points on meta tensors for every shape; return the distinct
    kernel specialisations they would launch, as (jit function, args, kwargs)."""
    from tilelang.jit import JITImpl

    rec = Recorder()
    original_call = JITImpl.__call__
    original_cu = chunk_mod._create_cu_seqlens
    JITImpl.__call__ = lambda self, *a, **k: rec(self, *a, **k)
    chunk_mod._create_cu_seqlens = lambda b, t, idx: torch.arange(b + 1, dtype=torch.int32) * t
    try:
        with _pretend_gpu(torch, sms):
            for shape in shapes:
                _run_shape(torch, flash_qla, shape, dense_batch)
    finally:
        JITImpl.__call__ = original_call
        chunk_mod._create_cu_seqlens = original_cu
    return list(rec.seen.values())


def _describe(jit_impl, args, kwargs) -> str:
    name = getattr(getattr(jit_impl, "func", None), "__name__", None) or repr(jit_impl)
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})".replace("torch.", "")


def main(argv=None) -> None:
    common = _benchmark_grid()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashqla-path", required=True, help="folder holding the peer's flash_qla/")
    ap.add_argument("--cache-dir", required=True, help="TileLang cache directory to fill")
    ap.add_argument("--heads", help="HK/HV,... (default: the benchmark grid's heads)")
    ap.add_argument("--layouts", help="layouts as in --shapes (default: the benchmark grid's)")
    ap.add_argument("--modes", default="fwd", help="fwd, bwd or fwd,bwd (default fwd)")
    ap.add_argument("--dense-batch", action="store_true",
                    help="uniform layouts as dense [B,T] (the benchmark's --dense-batch)")
    ap.add_argument("--sms", type=int, default=132, help="SM count of the device (H200: 132)")
    ap.add_argument("--list", action="store_true", help="print the variants, compile nothing")
    args = ap.parse_args(argv)

    os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    os.environ["TILELANG_DEFAULT_TARGET"] = json.dumps(TARGET)
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    import torch

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    shapes = []
    for mode in modes:
        heads = ([tuple(map(int, h.split("/"))) for h in args.heads.split(",")] if args.heads
                 else common.FWD_HEADS if mode == "fwd" else common.BWD_HEADS)
        layouts = (args.layouts.split(",") if args.layouts
                   else common.FWD_LAYOUTS if mode == "fwd" else common.BWD_LAYOUTS)
        shapes += [common.Shape(mode, hk, hv, lay).validate()
                   for hk, hv in heads for lay in layouts]

    flash_qla, chunk_mod = import_peer(args.flashqla_path, args.sms)
    t0 = time.time()
    variants = trace(torch, flash_qla, chunk_mod, shapes, args.sms, args.dense_batch)
    print(f"{len(shapes)} shapes -> {len(variants)} kernel variants ({time.time() - t0:.1f} s)")
    for i, (jit_impl, a, kw) in enumerate(variants):
        line = f"[{i + 1}/{len(variants)}] {_describe(jit_impl, a, kw)}"
        if args.list:
            print(line)
            continue
        t1 = time.time()
        jit_impl(*a, **kw)  # lazy-mode JIT: compiles (or hits the cache), launches nothing
        print(f"{line}: {time.time() - t1:.1f} s", flush=True)
    if not args.list:
        print(f"done in {time.time() - t0:.0f} s; cache: {args.cache_dir}")


if __name__ == "__main__":
    main()
