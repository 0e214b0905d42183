"""Time the Hopper forward's two kernels, per shape: the prepare and the recurrence.

For every shape (``HK/HV@LAYOUT``, as in ``bench_gated_delta_rule.py``) the script runs
the prepare kernel (``chunk_prepare_kernel``; its "err" column: A against the
torch backend's) and then the recurrence kernel (``chunk_fwd_ws_kernel``) on its outputs;
o and the final state are checked against the torch backend (fp32 chunked reference)
before the time is reported: a wrong kernel shows as a large error next to its time.
Times are CUDA-event medians (``triton.testing.do_bench``).

    python benchmark/tune_chunk_fwd.py --shapes '16/64@1x32768,2/8@1x2048'
    python benchmark/tune_chunk_fwd.py --compile-only --cache-dir .offline-gpu/tilelang-cache

``--compile-only`` builds both kernels for sm_90a without a GPU (TileLang's cache), so
the device's minutes go to running. Prints one table: ms and error per shape x kernel,
and the per-unit cost the planner's cost model holds (``flash_qla_tl.plan``): for the
recurrence "us/chunk" = ms / (waves of one CTA per (sequence, head) per SM x chunks of
the longest sequence), ``FWD_CHUNK_US``; for the prepare us per (chunk, value head),
``PREPARE_US_PER_CHUNK_HEAD``. The last line fits both (medians over the uniform-length
shapes).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DEFAULT_SHAPES = "16/64@1x32768,16/32@8x4096,16/16@4x8192,2/8@1x32768"
#: the kernels' names in the table ("ws longest-first": the recurrence with its grid
#: ordered longest sequence first, ``flash_qla_tl.layout.cta_order``, where that applies)
PREPARE, RECURRENCE, ORDERED = "prepare", "ws", "ws longest-first"


def compile_kernels(dtype="bfloat16"):
    from flash_qla_sm90.arch import served_arch
    from flash_qla_tl.kernels.chunk_cumsum_inverse import chunk_prepare_kernel
    from flash_qla_tl.kernels.chunk_state_output import chunk_fwd_ws_kernel

    arch = served_arch()                  # SM90, or FLASH_QLA_PROOF_ARCH's proof build
    chunk_prepare_kernel(arch, dtype, 128)
    for has_h0 in (False, True):
        chunk_fwd_ws_kernel(arch, dtype, 128, 128, has_h0, False)
        print("compiled", RECURRENCE, "h0" if has_h0 else "", flush=True)


def run_shape(shape, args):
    import torch
    from common import make_inputs, rel_err

    import flash_qla
    from flash_qla_sm90.arch import served_arch
    from flash_qla_tl.forward import state_output
    from flash_qla_tl.kernels.chunk_cumsum_inverse import chunk_prepare_kernel
    from flash_qla_tl.layout import cta_order, layout_for, packed
    from flash_qla_tl.plan import waves

    inp = make_inputs(shape, args.gate, args.seed, "cuda", with_grads=False)
    q, k, v, g, beta, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    cu = inp["cu_seqlens_cpu"].to("cuda", torch.int32)
    Tt, Hv = q.shape[1], v.shape[2]
    layout = layout_for(q, cu, served_arch())
    scale = 128 ** -0.5
    ref_g, ref_A, ref_o, _, ref_s = flash_qla.chunk_gated_delta_rule_fwd(
        q.float(), k.float(), v.float(), g, beta.float(), scale=scale, initial_state=h0,
        output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=inp["cu_seqlens_cpu"],
        backend="torch")

    k_p, beta_p, g_p = packed(k), packed(beta, torch.float32), packed(g, torch.float32)
    g_cumsum = torch.zeros(Tt, Hv, dtype=torch.float32, device="cuda")
    A = torch.zeros(Tt, Hv, 64, dtype=q.dtype, device="cuda")
    arch = served_arch()                  # SM90, or FLASH_QLA_PROOF_ARCH's proof build
    prep = chunk_prepare_kernel(arch, "bfloat16", 128)

    def prepare():
        prep(k_p, g_p, beta_p, layout.cu_seqlens, layout.chunk_idx, g_cumsum, A)

    prepare()
    lens = inp["cu_seqlens_cpu"].diff()
    chunks = int(((lens + 63) // 64).sum())
    ms = bench(prepare)
    rows = [[shape.label, PREPARE, f"{rel_err(A.view_as(ref_A), ref_A):.1e}", ms,
             round(ms * 1e3 / (chunks * Hv), 4)]]
    q_p, v_p = packed(q), packed(v)

    def forward(host_offsets=None):
        return state_output(q_p, k_p, v_p, g_cumsum, beta_p, A, layout, arch=arch,
                            scale=scale, initial_state=h0, num_chunks=None,
                            alloc=torch.empty,
                            order=cta_order(arch, host_offsets, Hv, q.device, layout.cu_seqlens))

    longest = int((lens.max() + 63) // 64)                 # chunks of the longest sequence
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rounds = waves(len(lens), Hv, sms)                     # of one CTA per SM
    kinds = [(RECURRENCE, None)]
    if cta_order(arch, inp["cu_seqlens_cpu"], Hv, q.device)[1]:   # the grid is reordered
        kinds.append((ORDERED, inp["cu_seqlens_cpu"]))
    for name, host_offsets in kinds:
        o, final, _ = forward(host_offsets)
        err = max(rel_err(o.view_as(ref_o), ref_o), rel_err(final, ref_s))
        ms = bench(functools.partial(forward, host_offsets))
        rows.append([shape.label, name, f"{err:.1e}", ms,
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
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"comma-separated HK/HV@LAYOUT (default {DEFAULT_SHAPES})")
    p.add_argument("--gate", default="model", choices=["model", "strong", "zero"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-only", action="store_true",
                   help="build both kernels for sm_90a (no GPU needed) and exit")
    p.add_argument("--cache-dir", help="TileLang cache directory (sets TILELANG_CACHE_DIR)")
    args = p.parse_args(argv)
    if args.cache_dir:
        os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    if args.compile_only:
        try:
            compile_kernels()
        except ImportError as e:
            print(f"tune_chunk_fwd.py --compile-only: needs flash-qla-sm90 and TileLang "
                  f"(pip install -e packages/flash-qla-tilelang -e packages/flash-qla-sm90; "
                  f"nvcc on PATH): {e}", file=sys.stderr)
            return 2
        return 0

    import torch

    if not torch.cuda.is_available():
        print("tune_chunk_fwd.py: needs a CUDA GPU (sm_90) and flash-qla[sm90] (from a "
              "clone: pip install -e packages/flash-qla-tilelang -e packages/flash-qla-sm90; "
              "--compile-only works without a GPU)", file=sys.stderr)
        return 2
    return tune(args)


def tune(args) -> int:
    """Run every shape and print the table."""
    from common import Shape
    from tabulate import tabulate

    from flash_qla_tl import plan

    rows = []
    for spec in args.shapes.split(","):
        shape_rows = run_shape(Shape.from_key(f"fwd:{spec}"), args)
        rows += shape_rows
        print(tabulate(shape_rows, tablefmt="plain"), flush=True)
    print(tabulate(rows, headers=["shape", "kernel", "err", "ms", "us/unit"],
                   tablefmt="github"))
    print(f"fitted {fit_costs(rows)}  (plan: FWD_CHUNK_US = {plan.FWD_CHUNK_US}, "
          f"PREPARE_US_PER_CHUNK_HEAD = {plan.PREPARE_US_PER_CHUNK_HEAD})")
    return 0


def fit_costs(rows) -> dict:
    """The cost model's constants from the table: per kernel, the median "us/unit" over
    the uniform-length shapes (varlen rows, whose waves are uneven, are left out).

    >>> fit_costs([["2/8 1x32768", "prepare", "", 0.07, 0.0167],
    ...            ["16/16 4x8192", "prepare", "", 0.13, 0.0159],
    ...            ["2/8 1x32768", "ws", "", 1.97, 3.85],
    ...            ["16/32 varlen-a (8 seqs)", "ws", "", 1.6, 25.0]])
    {'FWD_CHUNK_US': 3.85, 'PREPARE_US_PER_CHUNK_HEAD': 0.0163}
    """
    import statistics

    per_kernel: dict = {}
    for label, kernel, _, _, us in rows:
        if "varlen" in label or "seqs=" in label:
            continue
        per_kernel.setdefault(kernel, []).append(us)
    fitted = {}
    if RECURRENCE in per_kernel:
        fitted["FWD_CHUNK_US"] = round(statistics.median(per_kernel[RECURRENCE]), 2)
    if PREPARE in per_kernel:
        fitted["PREPARE_US_PER_CHUNK_HEAD"] = round(statistics.median(per_kernel[PREPARE]), 4)
    return fitted


if __name__ == "__main__":
    sys.exit(main())
