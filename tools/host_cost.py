"""Where an eager forward spends its host time (GPU debugging aid, sm90 backend).

For each shape (benchmark inputs, ``benchmark/common.make_inputs``; the backend's
automatic split), prints: the wall time of one ``chunk_gated_delta_rule`` call without a
sync, the host's own cost per call with the GPU held busy by a sleep kernel (no call
waits for it unless it syncs: ``(waited)``) and the host syncs of one call (torch's sync
debug mode), the GPU time of the same call (CUDA
events around 20 calls, synchronised), the host cost of each TileLang launch alone (the
last call's arguments replayed; ours only), and the top Python functions by own time
(``cProfile``, 200 calls). ``--backward``: the same for the backward of ours (the
autograd Function's ``backward`` called on this thread, where cProfile sees it: autograd
runs a CUDA backward on its own device thread). ``--fwd-bwd``: the benchmark's training
step (forward with grad + ``torch.autograd.grad``, as ``bench --mode bwd``'s fwd+bwd
column), wall, GPU and cProfile (on the device's Python 3.12 it lists the backward's
functions too), ours or FlashQLA; no per-launch costs. ``--trace DIR``: also the torch
profiler's timeline of 10 calls per shape (CPU ops, CUDA runtime / driver calls, kernels
and the Python functions that issue them), ``DIR/<shape>.json.gz`` for chrome://tracing
or Perfetto, and its ops by host time.
usage: python tools/host_cost.py [--shapes 2/8@1x32768,...]
[--impl flashqla --flashqla-path DIR] [--backward | --fwd-bwd] [--trace DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmark"))
import common as C  # noqa: E402


def _wall_us(fn, iters: int = 200) -> float:
    """Median wall time of ``fn`` without a sync between calls, microseconds
    (``benchmark/common.host_wall``, the profiler's host column)."""
    return C.host_wall(fn, iters)["wall_us"]


def _gpu_us(fn, iters: int = 20) -> float:
    """Mean time per call between CUDA events around ``iters`` back-to-back calls, us
    (``benchmark/common.time_back_to_back``, one run: the bench's back-to-back column)."""
    return C.time_back_to_back([fn], "cuda", calls=iters, repeats=1) * 1e3


class _Recorder:
    """Wraps a kernel builder of ``forward``: remembers the last launch's kernel and
    arguments, so that launch can be replayed alone."""

    def __init__(self, builder):
        self.builder, self.last = builder, None
        functools.update_wrapper(self, builder)

    def __call__(self, *static):
        from flash_qla_tl.launch import _direct

        kernel = _direct(self.builder(*static))            # what the launcher would call

        def record(*args):
            self.last = (kernel, args)
            return kernel(*args)
        return record


def _launch_costs(recorders: dict) -> dict:
    """Host us of one launch of each recorded kernel (its last arguments)."""
    out = {}
    for name, rec in recorders.items():
        if rec.last is None:
            continue
        kernel, args = rec.last
        out[f"{name} launch"] = _wall_us(functools.partial(kernel, *args))
    return out


def _trace(call, path: Path, top: int, iters: int = 10) -> str:
    """The torch profiler's timeline of ``iters`` calls (Python stacks on), written
    gzipped to ``path``; returns its ops by own host time (``top`` rows)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=True) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))              # torch gzips a path ending in .gz
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def _backward_call(impl, a: dict, inp: dict):
    """The backward of ours on a kept forward, as a plain call on this thread:
    ``_ChunkGatedDeltaRule.backward(ctx, do, dht)`` with the forward's own node as ctx."""
    from flash_qla import api

    o, final_state = impl.call(a)
    node = o.grad_fn
    while type(node).__name__ != "_ChunkGatedDeltaRuleBackward":     # past views / casts
        node = node.next_functions[0][0]
    outs = (o, final_state)                      # the graph (and its saved tensors) lives

    def backward(outs=outs):                     # as long as its outputs do
        return api._ChunkGatedDeltaRule.backward(node, inp["do"], inp["dht"])
    return backward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2/8@1x32768,2/8@1x8192,16/16@1x32768,16/16@4x8192",
                    help="comma-separated HK/HV@LAYOUT items (the benchmark's shape keys)")
    ap.add_argument("--profile-top", type=int, default=25,
                    help="Python functions listed per shape, by own time (cProfile)")
    ap.add_argument("--impl", choices=sorted(C.IMPLS), default="ours",
                    help="the benchmark's implementations: flashqla is FlashQLA 0.1.3 from "
                         "--flashqla-path, fla FLA's own kernels (FLA_FLASH_QLA=0), "
                         "fla-routed FLA routed to ours; per-launch costs for ours only")
    ap.add_argument("--flashqla-path")
    ap.add_argument("--fla-tune-rep-ms", type=float, default=10.0,
                    help="fla: ms per Triton autotune config (Triton's default: 100)")
    ap.add_argument("--backward", action="store_true",
                    help="the backward of ours instead of the forward (wall, GPU, cProfile)")
    ap.add_argument("--fwd-bwd", action="store_true",
                    help="the training step (forward + autograd.grad) instead of the forward")
    ap.add_argument("--dense-batch", action="store_true",
                    help="BxT layouts as dense [B, T] batches (no cu_seqlens), as the "
                         "benchmark's --dense-batch")
    ap.add_argument("--trace", type=Path,
                    help="folder for the torch profiler's timeline of each shape (json.gz)")
    args = ap.parse_args()
    if args.backward and args.fwd_bwd:
        ap.error("--backward and --fwd-bwd time different calls: pass one of them")
    if args.backward and args.impl != "ours":
        ap.error(f"--backward supports --impl ours only; got --impl {args.impl}")
    if not torch.cuda.is_available():
        print("error: tools/host_cost.py times CUDA launches and needs a CUDA GPU (none is "
              "visible)", file=sys.stderr)
        sys.exit(2)
    ctx = {"flashqla_path": args.flashqla_path, "fla_tune_rep_ms": args.fla_tune_rep_ms,
           "dense_batch": args.dense_batch}
    impl = C.IMPLS[args.impl]()
    impl.load(ctx)
    recorders = {}
    if args.impl == "ours" and not (args.backward or args.fwd_bwd):
        from flash_qla_tl import forward
        from flash_qla_tl.launch import launcher

        recorders["ws"] = forward.chunk_fwd_ws_kernel = _Recorder(forward.chunk_fwd_ws_kernel)
        recorders["prepare"] = forward.chunk_prepare_kernel = _Recorder(
            forward.chunk_prepare_kernel)
    rows, profiles = [], {}
    grads = args.backward or args.fwd_bwd
    for spec in args.shapes.split(","):
        shape = C.Shape.from_key(f"fwd:{spec}")
        inp = C.make_inputs(shape, "model", 0, "cuda", with_grads=grads)
        a = impl.prepare(inp, ctx)
        a_grad = impl.prepare(inp, ctx, requires_grad=True)
        if args.backward:
            call = _backward_call(impl, a_grad, inp)
        elif args.fwd_bwd:
            call = functools.partial(impl.fwd_bwd, a_grad, inp)
        else:
            call = functools.partial(impl.call, a)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        wall, held = C.host_wall(call, 200), C.host_behind_sleep(call)
        row = {"shape": spec, "api wall us": wall["wall_us"],
               "host us (GPU held)": (f"{held['held_us']:.1f}"
                                      + (" (waited)" if held["held_synced"] else "")),
               "syncs": len(wall["syncs"])}
        if not grads:
            row["api wall us (grad)"] = _wall_us(functools.partial(impl.call, a_grad))
        row["gpu us"] = _gpu_us(call)
        row.update(_launch_costs(recorders))
        if recorders:
            from flash_qla_sm90.arch import SM90

            row["ws launcher lookup us"] = _wall_us(functools.partial(
                launcher, recorders["ws"].builder, SM90, "bfloat16", 128, 128, True, False,
                True))
            row["prepare launcher lookup us"] = _wall_us(functools.partial(
                launcher, recorders["prepare"].builder, SM90, "bfloat16", 128))
        rows.append(row)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            call()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile_top)
        profiles[f"cProfile (200 calls), {spec}"] = s.getvalue()
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
            name = spec.replace("/", "-").replace("@", "_")
            profiles[f"torch profiler (10 calls), {spec}"] = _trace(
                call, args.trace / f"{name}.json.gz", args.profile_top)
    for head, text in profiles.items():
        print(f"### {head}\n{text}")
    print(tabulate([{k: (f"{v:.1f}" if isinstance(v, float) else v) for k, v in r.items()}
                    for r in rows], headers="keys"))


if __name__ == "__main__":
    main()
