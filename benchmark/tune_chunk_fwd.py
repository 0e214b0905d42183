"""Tune the Hopper forward kernels: time each prepare kernel and each ``chunk_fwd`` tiling.

For every shape (``HK/HV@LAYOUT``, as in ``bench_gated_delta_rule.py``) the script runs
every prepare kernel (its "err" column: A against the A of the prepare ``traits``
selects), then every fused-kernel tiling ``BLOCK_VxTHREADS[xSTAGES]`` on the
same inputs. Each tiling's o and final state are checked against the torch backend (fp32
chunked reference) before its time is reported: a wrong kernel shows as a large error
next to its time. Times are CUDA-event medians (``triton.testing.do_bench``).

    python benchmark/tune_chunk_fwd.py --tilings 64x256,32x256 --shapes '16/64@1x32768'
    python benchmark/tune_chunk_fwd.py --compile-only --cache-dir .offline-gpu/tilelang-cache

``--compile-only`` builds every prepare kernel and tiling for sm_90a without a GPU
(TileLang's cache), so the device's minutes go to running. Prints one table: ms and error
per shape x tiling, and "us/chunk" = ms / (waves of one CTA per SM x chunks of the longest
sequence), the per-chunk cost that ``traits.FWD_CHUNK_US`` (the tiling choice's cost
model) holds; the last line fits it (median per BLOCK_V over the uniform-length shapes).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DEFAULT_TILINGS = "64x256,32x256,32x128"
TRANSPOSED_SPECS = ("t", "ws")           # forward.TRANSPOSED_KERNELS (kept importless)
DEFAULT_SHAPES = "16/64@1x32768,16/32@8x4096,16/16@4x8192,2/8@1x32768"


def parse_tiling(spec: str) -> tuple:
    """``64x256`` -> (64, 256); ``64x256x3`` -> (64, 256, 3); ``t`` -> ("t",): the
    transposed-state kernel ``chunk_fwd_t`` (one CTA per sequence x head); ``ws`` ->
    ("ws",): the same with the aux warpgroup, ``chunk_fwd_ws``."""
    if spec in TRANSPOSED_SPECS:
        return (spec,)
    parts = tuple(int(x) for x in spec.split("x"))
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"bad tiling {spec!r}: expected BLOCK_VxTHREADS[xSTAGES]")
    return parts


def compile_tilings(tilings, dtype="bfloat16"):
    from flash_qla_sm90.kernels.chunk_fwd import chunk_fwd_kernel
    from flash_qla_sm90.kernels.chunk_prepare import PREPARE_KERNELS
    from flash_qla_sm90.kernels.forward import TRANSPOSED_KERNELS

    for prepare in PREPARE_KERNELS.values():
        prepare(dtype, 128)
    for t in tilings:
        for has_h0 in (False, True):
            if t[0] in TRANSPOSED_SPECS:
                TRANSPOSED_KERNELS[t[0]](dtype, 128, 128, has_h0, False)
            else:
                chunk_fwd_kernel(dtype, 128, 128, has_h0, False, *t)
            print("compiled", "x".join(map(str, t)), "h0" if has_h0 else "", flush=True)


def run_shape(shape, tilings, args):
    import torch
    from common import make_inputs, rel_err

    import flash_qla
    from flash_qla_sm90.kernels.chunk_prepare import PREPARE_KERNELS
    from flash_qla_sm90.kernels.forward import (
        _fused,
        _packed,
        layout_for,
        prepare_kernel_name,
        waves,
    )

    inp = make_inputs(shape, args.gate, args.seed, "cuda", with_grads=False)
    q, k, v, g, beta, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    cu = inp["cu_seqlens_cpu"].to("cuda", torch.int32)
    Tt, Hv = q.shape[1], v.shape[2]
    layout = layout_for(q, cu)
    scale = 128 ** -0.5
    ref_o, ref_s = flash_qla.chunk_gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta.float(), scale=scale, initial_state=h0,
        output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=inp["cu_seqlens_cpu"],
        backend="torch")

    k_p, beta_p, g_p = _packed(k), _packed(beta, torch.float32), _packed(g, torch.float32)
    g_cumsum = torch.zeros(Tt, Hv, dtype=torch.float32, device="cuda")
    rows, outputs = [], {}
    for name, builder in PREPARE_KERNELS.items():       # every prepare kernel, timed
        A = torch.zeros(Tt, Hv, 64, dtype=q.dtype, device="cuda")
        prep = builder("bfloat16", 128)

        def prepare(prep=prep, A=A):
            prep(k_p, g_p, beta_p, layout.cu_seqlens, layout.chunk_idx, g_cumsum, A)

        prepare()
        outputs[name] = A
        rows.append([shape.label, name, "", bench(prepare), ""])
    A = outputs[prepare_kernel_name()]                   # the one the forward runs
    for row, A_other in zip(rows, outputs.values()):     # err: A vs the forward's A
        row[2] = f"{rel_err(A_other, A):.1e}"
    lens = inp["cu_seqlens_cpu"].diff()
    longest = int((lens.max() + 63) // 64)                 # chunks of the longest sequence
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q_p, v_p = _packed(q), _packed(v)
    for t in tilings:
        def fused(tiling=t[0] if t[0] in TRANSPOSED_SPECS else t):
            return _fused(q_p, k_p, v_p, g_cumsum, beta_p, A, layout, scale=scale,
                          initial_state=h0, num_chunks=None, alloc=torch.empty, tiling=tiling)

        o, final, _ = fused()
        err = max(rel_err(o.view_as(ref_o), ref_o), rel_err(final, ref_s))
        ms = bench(fused)
        block_v = 128 if t[0] in TRANSPOSED_SPECS else t[0]
        rounds = waves(len(lens), Hv, 128, sms, block_v)       # of one CTA per SM
        rows.append([shape.label, "x".join(map(str, t)), f"{err:.1e}", ms,
                     round(ms * 1e3 / (rounds * longest), 2)])
    return rows


def bench(fn) -> float:
    """Median ms of ``fn`` (the benchmark's timer: ``triton.testing.do_bench``)."""
    from common import time_fns

    return round(time_fns([fn], "cuda", warmup_ms=25, rep_ms=100), 4)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--tilings", default=DEFAULT_TILINGS,
                   help=f"comma-separated BLOCK_VxTHREADS[xSTAGES] (default {DEFAULT_TILINGS})")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"comma-separated HK/HV@LAYOUT (default {DEFAULT_SHAPES})")
    p.add_argument("--gate", default="model", choices=["model", "strong", "zero"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-only", action="store_true",
                   help="build every tiling for sm_90a (no GPU needed) and exit")
    p.add_argument("--cache-dir", help="TileLang cache directory (sets TILELANG_CACHE_DIR)")
    args = p.parse_args(argv)
    tilings = [parse_tiling(s) for s in args.tilings.split(",")]
    if args.cache_dir:
        os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    if args.compile_only:
        try:
            compile_tilings(tilings)
        except ImportError as e:
            print(f"tune_chunk_fwd.py --compile-only: needs flash-qla-sm90 and TileLang "
                  f"(pip install -e packages/flash-qla-sm90; nvcc on PATH): {e}",
                  file=sys.stderr)
            return 2
        return 0

    import torch

    if not torch.cuda.is_available():
        print("tune_chunk_fwd.py: needs a CUDA GPU (sm_90) and flash-qla[sm90] (from a "
              "clone: pip install -e packages/flash-qla-sm90; --compile-only works without "
              "a GPU)", file=sys.stderr)
        return 2
    return tune(tilings, args)


def tune(tilings, args) -> int:
    """Run every shape x tiling and print the table."""
    from common import Shape
    from tabulate import tabulate

    rows = []
    for spec in args.shapes.split(","):
        shape_rows = run_shape(Shape.from_key(f"fwd:{spec}"), tilings, args)
        rows += shape_rows
        print(tabulate(shape_rows, tablefmt="plain"), flush=True)
    print(tabulate(rows, headers=["shape", "kernel", "err", "ms", "us/chunk"],
                   tablefmt="github"))
    from flash_qla_sm90.kernels import traits

    print(f"fitted FWD_CHUNK_US = {fit_chunk_us(rows)}  (traits: {traits.FWD_CHUNK_US}, "
          f"transposed: {traits.FWD_CHUNK_US_TRANSPOSED})")
    return 0


def fit_chunk_us(rows) -> dict:
    """``traits.FWD_CHUNK_US`` from the table: per BLOCK_V, the median "us/chunk" over the
    uniform-length shapes (varlen rows, whose waves are uneven, are left out); the
    transposed kernels' (``traits.FWD_CHUNK_US_TRANSPOSED``) under their names ("t", "ws").

    >>> fit_chunk_us([["2/8 1x32768", "32x256", "", 2.37, 4.63],
    ...               ["8/32 1x32768", "32x256", "", 2.29, 4.48],
    ...               ["2/8 1x32768", "prepare", "", 0.11, ""],
    ...               ["2/8 1x32768", "prepare-blocked", "", 0.07, ""],
    ...               ["16/32 varlen-a (8 seqs)", "64x256", "", 1.65, 6.4],
    ...               ["2/8 1x32768", "t", "", 3.02, 5.89]])
    {32: 4.55, 't': 5.89}
    """
    import statistics

    per_bv: dict = {}
    for label, kernel, _, _, us in rows:
        if kernel.startswith("prepare") or "varlen" in label or "seqs=" in label:
            continue
        per_bv.setdefault(parse_tiling(kernel)[0], []).append(us)
    order = sorted(per_bv, key=lambda bv: (isinstance(bv, str), bv))     # BLOCK_Vs, then "t", "ws"
    return {bv: round(statistics.median(per_bv[bv]), 2) for bv in order}


if __name__ == "__main__":
    sys.exit(main())
