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


#: SASS that ends a step of a role: a wait for WGMMA results, an mbarrier's try-wait
#: (its retry branch follows it) or a named barrier
STEP_ENDS = ("WARPGROUP.DEPBAR", "SYNCS.PHASECHK", "BAR.SYNC")


def split_by_step(per_insn) -> list[tuple]:
    """Each role's instructions cut into steps, a step ending at a wait
    (:data:`STEP_ENDS`): ``(role, first index, last index, samples, executed share of
    the role's loop body, the step's last SASS)``. The samples of the instructions
    between two waits are the time the role spends issuing that stretch (and waiting
    on its operands), so a stretch of stores after the chain's last wait shows up as
    its own step."""
    steps, cur = [], None
    for n, idx, role, source, _ in per_insn:
        if cur is None or cur[0] != role:
            cur = [role, idx, idx, 0, source]
            steps.append(cur)
        cur[2], cur[3], cur[4] = idx, cur[3] + n, source
        if source.startswith(STEP_ENDS):
            cur = [role, idx + 1, idx + 1, 0, ""]
            steps.append(cur)
    return [tuple(s) for s in steps if s[3]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu-sass.csv (or .csv.xz) of one kernel")
    p.add_argument("--top", type=int, default=25, help="instructions to list")
    p.add_argument("--steps", action="store_true",
                   help="also each role's samples per step between two waits")
    args = p.parse_args(argv)
    from tabulate import tabulate  # the bench extra; reading needs only the stdlib

    per_role, per_insn = split_by_role(*read_rows(args.csv))
    total = sum(v[0] for v in per_role.values()) or 1
    print(tabulate([(k, s, f"{s / total:.1%}", e) for k, (s, e) in per_role.items()],
                   headers=["role", "samples", "share", "executed"]))
    print()
    if args.steps:
        print(tabulate([(r, f"{a}-{b}", n, f"{n / total:.1%}", src[:60])
                        for r, a, b, n, src in split_by_step(per_insn)],
                       headers=["role", "SASS #", "samples", "share", "ends at"]))
        print()
    top = sorted(per_insn, reverse=True)[:args.top]
    print(tabulate([(n, f"{n / total:.1%}", i, r, s[:70], why) for n, i, r, s, why in top],
                   headers=["samples", "share", "#", "role", "SASS", "top stalls"]))


if __name__ == "__main__":
    main()
