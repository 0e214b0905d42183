#!/usr/bin/env python3
"""Decode (one token per sequence) and speculative verify (a few tokens per sequence):
ours (``flash_qla.fused_recurrent_gated_delta_rule``, sm90 ``recurrent_step``) beside
FLA's ``fused_recurrent_gated_delta_rule`` (Triton), same inputs, CUDA-graph replay
times (a decode step is launch-bound eagerly) and both outputs against the fp64
recurrence; FlashInfer 0.7's decode kernel beside them where installed (one token per
sequence); also on an engine's state pool (ours through ``state_indices``, FLA with a
gather and a scatter). Prints one table; ``--out FILE`` also writes it as JSON.

    python benchmark/bench_decode.py [--seqs 32,256] [--tokens 1,4] [--heads 16/32]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from tabulate import tabulate


def graph_ms(fn, reps: int = 200) -> float:
    """Mean ms of one CUDA-graph replay of ``fn`` (captured once on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def rel_l2(x, ref) -> float:
    """Relative L2 error of ``x`` against the fp64 ``ref``."""
    return ((x.double() - ref).norm() / ref.norm()).item()


def _pool_row(flash_qla, fla_step, q, k, v, g, beta, h0, ref, gen) -> dict:
    """The same step on an engine's state pool ``[2N, Hv, K, V]`` fp32 (slots a random
    permutation): ours through ``state_indices`` (read and written in place), FLA by a
    gather and a scatter around its call; ours also on the v-first layout with beta in
    bf16. Each graph replay updates the pool, so the error is checked on a first eager
    call from a fresh copy (beta in bf16 adds its rounding to that row's error)."""
    N = q.shape[0]
    slots = torch.randperm(2 * N, generator=gen)[:N].cuda()
    pool = torch.zeros(2 * N, *h0.shape[1:], device="cuda")
    pool[slots] = h0
    fresh = pool.clone()

    def ours():
        return flash_qla.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=pool, output_final_state=True,
            state_indices=slots)[0]

    row = {"pool ours ms": graph_ms(ours)}
    pool.copy_(fresh)
    row["pool ours err"] = rel_l2(ours(), ref)
    if fla_step is not None:
        def theirs():
            o, ht = fla_step(q, k, v, g, beta=beta, initial_state=pool[slots],
                             output_final_state=True)
            pool[slots] = ht
            return o

        row["pool FLA ms"] = graph_ms(theirs)
        pool.copy_(fresh)
        row["pool FLA err"] = rel_l2(theirs(), ref)
        row["pool ours vs FLA"] = row["pool FLA ms"] / row["pool ours ms"]
    # the v-first fp32 pool (FlashInfer's decode layout, and the prefill's on a pool),
    # beta in bf16 as a model's sigmoid gives it (read as given: no conversion launch)
    pool_v = pool.transpose(-1, -2).contiguous()
    fresh_v = fresh.transpose(-1, -2).contiguous()
    beta_bf16 = beta.bfloat16()

    def ours_v_first():
        return flash_qla.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta_bf16, initial_state=pool_v, output_final_state=True,
            state_indices=slots, state_v_first=True)[0]

    row["pool v-first ours ms"] = graph_ms(ours_v_first)
    pool_v.copy_(fresh_v)
    row["pool v-first ours err"] = rel_l2(ours_v_first(), ref)
    return row


def _flashinfer_row(fi_step, q, k, v, A_log, a, dt_bias, b, h0, ref, ours_ms) -> dict:
    """FlashInfer's decode step on the same token: its state ``[N, Hv, V, K]`` (v-first)
    fp32, updated in place (each replay advances it; the error is checked on a first call
    from a fresh copy), the gate and beta computed in its kernel from the raw inputs."""
    state0 = h0.transpose(-1, -2).contiguous()
    state = state0.clone()

    def theirs():
        return fi_step(q, k, v, state, A_log, a, dt_bias, b, use_qk_l2norm=False)[0]

    row = {"FlashInfer ms": graph_ms(theirs)}
    state.copy_(state0)
    row["FlashInfer err"] = rel_l2(theirs(), ref)
    if ours_ms is not None:
        row["ours vs FlashInfer"] = row["FlashInfer ms"] / ours_ms
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32,256", help="sequences per step (comma list)")
    p.add_argument("--tokens", default="1,4", help="tokens per sequence (comma list)")
    p.add_argument("--heads", default="16/32", help="Hk/Hv (comma list)")
    p.add_argument("--no-pool", action="store_true",
                   help="skip the state-pool rows (an engine's pool of 2N slots: ours reads "
                        "and writes it in place through state_indices, FLA by a gather "
                        "and a scatter around its call, both in the graph)")
    p.add_argument("--impls", default="ours,fla,flashinfer",
                   help="comma list of ours, fla, flashinfer (an absent peer is skipped); "
                        "flashinfer: FlashInfer 0.7's gated_delta_rule_decode_pretranspose, "
                        "one token per sequence, fp32 state (its legacy kernel), the gate "
                        "and beta from their raw inputs in its kernel")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    impls = set(args.impls.split(","))
    import flash_qla
    from flash_qla.reference import recurrent_gated_delta_rule
    fla_step = fi_step = None
    if "fla" in impls:
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_step
        except ImportError:
            pass
    if "flashinfer" in impls:
        try:
            from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose as fi_step
        except ImportError:
            pass
    rows = []
    for heads in args.heads.split(","):
        Hk, Hv = map(int, heads.split("/"))
        for N in map(int, args.seqs.split(",")):
            for T in map(int, args.tokens.split(",")):
                gen = torch.Generator().manual_seed(0)
                q, k = (F.normalize(torch.randn(N, T, Hk, 128, generator=gen), dim=-1)
                        .bfloat16().cuda() for _ in range(2))
                v = torch.randn(N, T, Hv, 128, generator=gen).bfloat16().cuda()
                # a model's raw gate inputs (FlashInfer takes these), and g, beta from them
                # in fp32 (ours and FLA take these): g = -exp(A_log) softplus(a + dt_bias)
                a = torch.randn(N, T, Hv, generator=gen).bfloat16().cuda()
                b = torch.randn(N, T, Hv, generator=gen).bfloat16().cuda()
                A_log = torch.log(torch.empty(Hv).uniform_(1.0, 16.0, generator=gen)).cuda()
                dt_bias = (torch.rand(Hv, generator=gen) - 4.0).cuda()
                g = -torch.exp(A_log) * F.softplus(a.float() + dt_bias)
                beta = torch.sigmoid(b.float())
                h0 = (0.1 * torch.randn(N, Hv, 128, 128, generator=gen)).cuda()
                ref, _ = recurrent_gated_delta_rule(q.double(), k.double(), v.double(),
                                                    g.double(), beta.double(),
                                                    initial_state=h0.double())
                row = {"heads": heads, "seqs": N, "tokens": T}
                if "ours" in impls:
                    ours = functools.partial(flash_qla.fused_recurrent_gated_delta_rule, q,
                                             k, v, g, beta=beta, initial_state=h0,
                                             output_final_state=True)
                    row.update({"ours ms": graph_ms(ours), "ours err": rel_l2(ours()[0], ref)})
                if fi_step is not None and T == 1:
                    row.update(_flashinfer_row(fi_step, q, k, v, A_log, a, dt_bias, b, h0,
                                               ref, row.get("ours ms")))
                if fla_step is not None:
                    theirs = functools.partial(fla_step, q, k, v, g, beta=beta,
                                               initial_state=h0, output_final_state=True)
                    row["FLA ms"] = graph_ms(theirs)
                    row["FLA err"] = rel_l2(theirs()[0], ref)
                    if "ours ms" in row:
                        row["ours vs FLA"] = row["FLA ms"] / row["ours ms"]
                if not args.no_pool and "ours" in impls:
                    row.update(_pool_row(flash_qla, fla_step, q, k, v, g, beta, h0, ref, gen))
                rows.append(row)
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
