"""Time the decode kernel's block shapes: ``recurrent_step`` with ``(BV, threads)`` =
state columns per CTA and threads per CTA, each checked against the fp64 recurrence.

Every configuration is the shipped program (``flash_qla_tl.kernels.recurrent_step``)
built with other values of its two module constants, launched directly with the
arguments ``flash_qla_tl.recurrent.recurrent_fwd`` passes: sequences of T tokens, states
in a pool at permuted slots (one slot negative: a padding row, zero start, never written),
fp32 pool, bf16 q/k/v. Times: CUDA-graph replay, ms. The "err" columns are the relative
L2 error of o and of the written pool rows against fp64: a wrong configuration shows next
to its time.

    python benchmark/tune_decode.py [--configs 32x128,8x32,16x32] [--seqs 32,256]
    python benchmark/tune_decode.py --compile-only      # sm_90a, into TileLang's cache
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys


@contextlib.contextmanager
def _block(bv: int, threads: int):
    """The kernel module's two constants set to one configuration while it is built."""
    from flash_qla_tl.kernels import recurrent_step as mod

    saved = mod.STEP_BLOCK_V, mod.STEP_THREADS
    mod.STEP_BLOCK_V, mod.STEP_THREADS = bv, threads
    try:
        yield mod
    finally:
        mod.STEP_BLOCK_V, mod.STEP_THREADS = saved


def build(bv: int, threads: int, has_h0: bool = True, dtype: str = "bfloat16"):
    """The compiled kernel of one configuration (sm_90a; TileLang's disk cache)."""
    import tilelang

    from flash_qla_sm90.arch import SM90

    with _block(bv, threads) as mod:
        program = mod.recurrent_step_kernel.program(SM90, dtype, 128, 128, has_h0)
    return tilelang.compile(program, target=SM90.target_dict,
                            pass_configs=SM90.kernel_pass_configs())


def _problem(N: int, T: int, Hk: int, Hv: int):
    """Inputs as the host path packs them, a pool of 2N slots, the fp64 reference (o, the
    live rows' final states), which rows are live, and the pool's fresh copy."""
    import torch
    import torch.nn.functional as F

    from flash_qla.reference import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(N, T, Hk, 128, generator=gen), dim=-1).bfloat16()
            for _ in range(2))
    v = torch.randn(N, T, Hv, 128, generator=gen).bfloat16()
    g = -torch.rand(N, T, Hv, generator=gen) * 2
    beta = torch.rand(N, T, Hv, generator=gen)
    h0 = 0.1 * torch.randn(N, Hv, 128, 128, generator=gen)
    slots = torch.randperm(2 * N, generator=gen)[:N].to(torch.int32)
    slots[N // 2] = -1                                        # a padding row
    ref_o, ref_h = recurrent_gated_delta_rule(
        q.double(), k.double(), v.double(), g.double(), beta.double(),
        initial_state=torch.where((slots >= 0)[:, None, None, None], h0, 0).double(),
        output_final_state=True)
    pool = torch.zeros(2 * N, Hv, 128, 128)
    live = slots >= 0
    pool[slots[live].long()] = h0[live]
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    dev = {n: x.cuda() for n, x in dict(q=q, k=k, v=v, g=g, beta=beta, slots=slots,
                                          pool=pool, cu=cu).items()}
    return dev, ref_o.cuda(), ref_h.cuda(), live.cuda(), dev["pool"].clone()


def run_config(kernel, problem) -> dict:
    """One configuration on one :func:`_problem` (its pool reset first)."""
    import torch
    from bench_decode import graph_ms, rel_l2  # the decode benchmark's timer, error

    p, ref_o, ref_h, live, fresh = problem
    p["pool"].copy_(fresh)
    N, T, Hk = p["q"].shape[:3]
    Hv = p["v"].shape[2]
    o = torch.zeros(N * T, Hv, 128, dtype=torch.bfloat16, device="cuda")
    call = functools.partial(
        kernel, p["q"].view(N * T, Hk, 128), p["k"].view(N * T, Hk, 128),
        p["v"].view(N * T, Hv, 128), p["g"].view(N * T, Hv), p["beta"].view(N * T, Hv),
        p["cu"], p["slots"], p["pool"], 128 ** -0.5, o, p["pool"])
    call()
    torch.cuda.synchronize()
    slots = p["slots"][live].long()
    err_o = rel_l2(o.view(N, T, Hv, 128), ref_o)
    err_h = rel_l2(p["pool"][slots], ref_h[live])
    other = torch.ones(p["pool"].shape[0], dtype=torch.bool, device="cuda")
    other[slots] = False                       # rows no live slot names: never written
    untouched = torch.equal(p["pool"][other], fresh[other])
    ms = graph_ms(call)
    return {"ms": ms, "err o": err_o, "err state": err_h, "padding row kept": untouched}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="32x128,8x32,16x32,16x64",
                    help="BVxTHREADS items (the shipped one: 16x32; before it, 32x128)")
    ap.add_argument("--seqs", default="32,256")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--heads", default="16/32")
    ap.add_argument("--compile-only", action="store_true",
                    help="build every configuration for sm_90a (no GPU needed) and exit")
    args = ap.parse_args(argv)
    configs = [tuple(map(int, c.split("x"))) for c in args.configs.split(",")]
    kernels = {c: build(*c) for c in configs}
    if args.compile_only:
        print(f"compiled {len(kernels)} configurations")
        return
    import torch
    from tabulate import tabulate

    if not torch.cuda.is_available():
        sys.exit("tune_decode.py times CUDA kernels and needs a GPU (or --compile-only)")
    rows = []
    for heads in args.heads.split(","):
        Hk, Hv = map(int, heads.split("/"))
        for N in map(int, args.seqs.split(",")):
            for T in map(int, args.tokens.split(",")):
                problem = _problem(N, T, Hk, Hv)
                for (bv, threads), kernel in kernels.items():
                    rows.append({"heads": heads, "seqs": N, "tokens": T,
                                 "BV x threads": f"{bv}x{threads}",
                                 **run_config(kernel, problem)})
    print(tabulate(rows, headers="keys", floatfmt=".4g"))


if __name__ == "__main__":
    main()
