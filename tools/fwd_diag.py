"""Stage-by-stage comparison of the sm90 forward with the torch backend (GPU debugging aid).

Prints, per small case, the relative L2 error of every forward output, so a wrong stage
(gate cumsum, inverse A, output, final state, h) is visible at once.
usage: python tools/fwd_diag.py
"""

import torch
import torch.nn.functional as F
from tabulate import tabulate

import flash_qla
from tests.helpers import rel_l2

CASES = {  # name: (B, T, Hk, Hv, lens or None, with initial state)
    "T64": (1, 64, 1, 1, None, False),
    "T64-h0": (1, 64, 1, 1, None, True),
    "T128": (1, 128, 1, 1, None, False),
    "T1000-gva": (2, 1000, 2, 4, None, True),
    "varlen": (1, 300, 1, 2, [1, 63, 0, 75, 130], True),
}


def inputs(B, T, Hk, Hv, lens, h0):
    dev, K = "cuda", 128
    q = F.normalize(torch.randn(B, T, Hk, K, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, Hk, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(B, T, Hv, K, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, Hv, device=dev) + 3)
    beta = torch.sigmoid(torch.randn(B, T, Hv, device=dev))
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0)], device=dev,
                                                dtype=torch.int32)
    N = B if lens is None else len(lens)
    s0 = torch.randn(N, Hv, K, K, device=dev) * 0.1 if h0 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, cu_seqlens=cu)


rows = []
for name, spec in CASES.items():
    inp = inputs(*spec)
    ours = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_h=True)
    ref = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_h=True, backend="torch")
    rows.append([name] + [f"{rel_l2(a.float(), b.float()):.2e}" for a, b in zip(ours, ref)])
print(tabulate(rows, headers=["case", "g_cumsum", "A", "o", "h", "final_state"]))
