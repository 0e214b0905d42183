"""Time the Hopper backward's reverse kernels: the fused kernel against the sweep + the
per-chunk gradient kernel it replaces.

For every shape (``HK/HV@LAYOUT``, as in ``bench_gated_delta_rule.py``) the script runs
the forward once (g_cumsum, A, the chunk states h in q's dtype), then times, on the same
inputs and with no segment split, (a) ``chunk_bwd_dh_ws`` (dS1 in q's dtype) followed by
``chunk_bwd_intra`` (+ the GVA sum) and (b) ``chunk_bwd_fused`` (+ the GVA sum). Each
output of (b) (dq, dk, dv, dbeta, dg, dh0) is compared with (a)'s before its time is
reported ("err": the largest relative L2 error). "us/step" is (b)'s time per chunk step of
one CTA: ms / (waves of one CTA per (sequence, value head) per SM x chunks of the longest
sequence). Times are CUDA-event medians (``triton.testing.do_bench``).

    python benchmark/tune_chunk_bwd.py --shapes '16/16@8x4096,4/16@1x32768'
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DEFAULT_SHAPES = "16/16@8x4096,16/32@8x4096,4/16@8x4096,16/16@1x32768"


def run_shape(shape, args):
    import torch
    from common import make_inputs, rel_err
    from tune_chunk_fwd import bench

    import flash_qla
    from flash_qla_sm90.arch import served_arch
    from flash_qla_tl.backward import chunk_grads, chunk_states, fused_grads, pack, state_grads
    from flash_qla_tl.layout import host_chunks
    from flash_qla_tl.plan import waves

    inp = make_inputs(shape, args.gate, args.seed, "cuda", with_grads=False)
    q, k, v, g, beta, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    cu = inp["cu_seqlens_cpu"].to("cuda", torch.int32)
    scale = 128 ** -0.5
    g_cumsum, A, o, _, final = flash_qla.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
        cu_seqlens=cu, cu_seqlens_cpu=inp["cu_seqlens_cpu"])
    do, dht = torch.randn_like(o), torch.randn_like(final)
    # SM90's kernels, or FLASH_QLA_PROOF_ARCH's proof build
    common = dict(arch=served_arch(), scale=scale, cu_seqlens=cu,
                  cu_seqlens_cpu=inp["cu_seqlens_cpu"])
    p = pack(q, k, v, g_cumsum, beta, A, do, cu, arch=common["arch"])
    h = chunk_states(q, k, v, g_cumsum, beta, A, initial_state=h0, packed=p,
                     **common)                                       # in q's dtype

    def two_kernels():
        dS1, dh0 = state_grads(q, k, do, g_cumsum, beta, A, dht=dht, packed=p, **common)
        return (*chunk_grads(q, k, v, g_cumsum, beta, A, do, h, dS1, packed=p, **common),
                dh0)

    def fused():
        return fused_grads(q, k, v, g_cumsum, beta, A, do, h, dht=dht, packed=p, **common)

    base, ours = two_kernels(), fused()
    err = max(rel_err(a, b) for a, b in zip(ours, base))
    ms_base, ms_fused = bench(two_kernels), bench(fused)
    chunks = host_chunks(inp["cu_seqlens_cpu"])              # per sequence
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rounds = waves(len(chunks), v.shape[2], sms)             # one CTA per (walk, head)
    longest = max(chunks)
    return [shape.label, len(chunks) * v.shape[2], f"{err:.1e}", ms_base, ms_fused,
            round(ms_base / ms_fused, 2), round(ms_fused * 1e3 / (rounds * longest), 2)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"comma-separated HK/HV@LAYOUT (default {DEFAULT_SHAPES})")
    p.add_argument("--gate", default="model", choices=["model", "strong", "zero"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    import torch

    if not torch.cuda.is_available():
        print("tune_chunk_bwd.py: needs a CUDA GPU (sm_90) and flash-qla[sm90]",
              file=sys.stderr)
        return 2
    from common import Shape
    from tabulate import tabulate

    rows = []
    for spec in args.shapes.split(","):
        rows.append(run_shape(Shape.from_key(f"bwd:{spec}"), args))
        print(tabulate(rows[-1:], tablefmt="plain"), flush=True)
    print(tabulate(rows, headers=["shape", "CTAs", "err", "dh_ws + intra ms", "fused ms",
                                  "speedup", "us/step"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
