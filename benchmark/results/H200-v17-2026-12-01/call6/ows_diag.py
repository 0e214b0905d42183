"""Where the output-warpgroup forward's o differs from the default ws kernel's (v17 call 6).

Run on a GPU from the repository root, branch ``next/fwd-output-warpgroup`` (the kernels
compiled into the offline bundle): ``python3 <this file>``; prints, per case and per
64-token chunk x value head, the largest difference between the two kernels' o.
"""
import sys

import torch

sys.path.insert(0, ".")
import flash_qla
from flash_qla_sm90.kernels import traits
from tests.sm90.test_forward_gpu import Case, make_inputs

traits.FWD_TRANSPOSED = True
traits.FWD_AUX_WARPGROUP = True
traits.FWD_CHUNK_US_TRANSPOSED = {"t": 0.0, "ws": 0.0}
for case in (Case(1, 128, 1, 1), Case(1, 256, 1, 1), Case(1, 1000, 2, 4), Case(2, 1000, 2, 4)):
    inp = make_inputs(case, seed=9)
    outs = {}
    for ows in (False, True):
        traits.FWD_OUTPUT_WARPGROUP = ows
        for h_out in (False, True):
            r = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True, output_h=h_out)
            outs[ows, h_out] = (r[2].float(), r[4].float())
    for h_out in (False, True):
        a, b = outs[False, h_out][0], outs[True, h_out][0]       # [B, T, Hv, V]
        d = (a - b).abs()
        nf = (~torch.isfinite(b)).sum().item()
        B, T = a.shape[:2]
        print(f"case B{case.B} T{case.T} Hk{case.Hk} Hv{case.Hv} output_h={h_out}: nonfinite {nf}, "
              f"max diff {d.nan_to_num(1e30).max().item():.3e}, final diff "
              f"{(outs[False, h_out][1] - outs[True, h_out][1]).abs().max().item():.3e}")
        # per chunk x head: max diff (rows of 64 tokens)
        rows = []
        for c0 in range(0, T, 64):
            blk = d[:, c0:c0 + 64].nan_to_num(1e30)
            rows.append(" ".join(f"{blk[:, :, hh].max().item():.0e}" for hh in range(a.shape[2])))
        print("   per chunk (heads):", " | ".join(rows[:17]))
        bad = (d.nan_to_num(1e30) > 1e-2).nonzero()
        if len(bad):
            print("   first bad (b, t, h, v):", bad[:6].tolist(), "count", len(bad))
