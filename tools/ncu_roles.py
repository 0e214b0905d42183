#!/usr/bin/env python3
"""Warp-stall samples of one kernel split by warp role, from Nsight Compute's per-SASS CSV.

``tools/h200_session.sh`` with ``NCU_SOURCE=1`` writes ``ncu-sass.csv`` (``ncu --page
source --csv --print-source sass``): one row per SASS instruction with its stall samples.
In a warp-specialised kernel (``chunk_fwd_ws``, ``chunk_bwd_dh_ws``) each role's code
starts at its ``USETMAXREG`` (``.DEALLOC``: the role that gives registers away, the aux
warpgroup; otherwise the one that takes them, the state warpgroups), so the instructions
between two of them belong to one role. Prints, per role, the samples and instructions
executed, then the instructions with the most samples and their top stall reasons.

Usage: python3 tools/ncu_roles.py ncu-sass.csv[.xz] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import csv
import lzma

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """Header and instruction rows of an ncu source-page CSV (plain or .xz); the first
    line names the kernel, the second is the header."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    return rows[1], [r for r in rows[2:] if len(r) == len(rows[1])]


def role_of(source: str, current: str, index: int) -> str:
    """The role an instruction starts, or ``current`` (roles are named by where their
    ``USETMAXREG`` sits: ``aux@i`` gives registers away, ``state@i`` takes them)."""
    if "USETMAXREG" not in source:
        return current
    return f"{'aux' if 'DEALLOC' in source else 'state'}@{index}"


def split_by_role(header: list[str], rows: list[list[str]]):
    """``(per_role, per_instruction)``: samples and executed count per role; per
    instruction ``(samples, index, role, source, top stall reasons)``."""
    src, smp, exe = header.index("Source"), header.index(SAMPLES), header.index(EXECUTED)
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(header)
               if h.startswith("stall_") and "Not Issued" not in h]
    per_role = collections.defaultdict(lambda: [0, 0])
    per_insn = []
    role = "prologue"
    for idx, r in enumerate(rows):
        role = role_of(r[src], role, idx)
        n = int(r[smp] or 0)
        per_role[role][0] += n
        per_role[role][1] += int(r[exe] or 0)
        top = sorted(((int(r[i] or 0), name) for i, name in reasons), reverse=True)[:2]
        per_insn.append((n, idx, role, r[src].strip(),
                         ", ".join(f"{name} {c}" for c, name in top if c)))
    return dict(per_role), per_insn


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu-sass.csv (or .csv.xz) of one kernel")
    p.add_argument("--top", type=int, default=25, help="instructions to list")
    args = p.parse_args(argv)
    from tabulate import tabulate  # the bench extra; reading needs only the stdlib

    per_role, per_insn = split_by_role(*read_rows(args.csv))
    total = sum(v[0] for v in per_role.values()) or 1
    print(tabulate([(k, s, f"{s / total:.1%}", e) for k, (s, e) in per_role.items()],
                   headers=["role", "samples", "share", "executed"]))
    print()
    top = sorted(per_insn, reverse=True)[:args.top]
    print(tabulate([(n, f"{n / total:.1%}", i, r, s[:70], why) for n, i, r, s, why in top],
                   headers=["samples", "share", "#", "role", "SASS", "top stalls"]))


if __name__ == "__main__":
    main()
