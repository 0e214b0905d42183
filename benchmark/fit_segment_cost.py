"""Fit the segment-split cost model of the sm90 planner from benchmark results.

``flash_qla_tl.plan.segment_len`` (issue 6) predicts a split's time from the fitted
recurrence and prepare costs plus constants kept in ``flash_qla_tl.plan``; this
script refits those constants from ``bench_gated_delta_rule.py`` result files (JSON,
e.g. the ``seg`` / ``fla`` stages of ``tools/h200_session.sh``):

- ``--exact FILE...``: rows of the exact split (three passes + a scan).
  ``measured - 3 x recurrence(pieces) - prepare(pieces) = steps x SEGMENT_SCAN_STEP_US +
  SEGMENT_FIXED_US``, least squares over the rows.
- ``--bounded FILE...``: rows of the bounded split (one warm-up pass). Eager calls
  there are host-bound, so ``WARMUP_HOST_US`` is the median measured time of the rows
  whose predicted GPU time is below it.

The segment length of a row is the run's ``--ours-segment-len`` (from the file's
recorded command) or, without it, what the planner picks for the shape now. Rows of
other implementations, failed rows and ``--ours-segment-len off`` runs are skipped.

    python benchmark/fit_segment_cost.py \\
        --exact benchmark/results/H200-v5-2026-11-30/call3/H200-seg-{1024,2048,4096}.json \\
        --bounded benchmark/results/H200-v6-2026-11-30/call4/H200-fla.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
for pkg in ("flash-qla-core", "flash-qla-sm90"):                  # a source checkout
    sys.path.insert(0, os.path.join(ROOT, "packages", pkg, "src"))

import common as C  # noqa: E402

SM_COUNT = 132          # the H200 the results come from


def _rows(path: str, bounded: bool) -> list[dict]:
    """Our ok rows of one result file, each with its segment length (``seg``),
    sequence lengths (``lens``) and measured ``us``."""
    from flash_qla_tl import plan

    with open(path) as f:
        data = json.load(f)
    argv = shlex.split(data["meta"].get("command") or "")
    forced = argv[argv.index("--ours-segment-len") + 1] if "--ours-segment-len" in argv else None
    if forced == "off":
        return []
    rows = []
    for r in data["results"]:
        if r.get("impl") != "ours" or r.get("status") != "ok" or r.get("eager_ms") is None:
            continue
        shape = C.select_shapes(r["shape"].split(":", 1)[1], ["fwd"], C.forward_grid())[0]
        bounds = [0, *[sum(shape.seqlens[:i + 1]) for i in range(len(shape.seqlens))]]
        seg = int(forced) if forced else plan.segment_len(
            bounds, shape.hv, SM_COUNT, bounded=bounded).value
        if seg:
            rows.append({"shape": r["shape"].split(":", 1)[1], "hv": shape.hv,
                         "lens": shape.seqlens, "seg": seg, "us": r["eager_ms"] * 1e3,
                         "file": os.path.relpath(path, ROOT)})
    return rows


def fit_exact(rows: list[dict]) -> tuple[float, float]:
    """``(SEGMENT_SCAN_STEP_US, SEGMENT_FIXED_US)`` by least squares; each row gets its
    ``pred`` with them. Needs two distinct step counts.

    >>> fit_exact([{"x": 2, "y": 100.0}, {"x": 4, "y": 200.0}, {"x": 8, "y": 400.0}])
    (50.0, 0.0)
    """
    xs = [r["x"] for r in rows]
    ys = [r["y"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    step = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return step, my - step * mx


def _exact_terms(rows: list[dict]) -> None:
    """x = scan steps, y = measured minus the passes the model already prices."""
    from flash_qla_tl import plan

    for r in rows:
        r["x"] = -(-max(r["lens"]) // r["seg"])
        r["y"] = r["us"] - plan.exact_passes_us(r["lens"], r["hv"], SM_COUNT, r["seg"])


def main(argv=None) -> int:
    from flash_qla_tl import plan

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exact", nargs="*", default=[], help="result JSONs of exact splits")
    p.add_argument("--bounded", nargs="*", default=[], help="result JSONs of bounded splits")
    args = p.parse_args(argv)
    exact = [r for path in args.exact for r in _rows(path, bounded=False)]
    bounded = [r for path in args.bounded for r in _rows(path, bounded=True)]
    _exact_terms(exact)
    if len({r["x"] for r in exact}) >= 2:                # two step counts at least
        step, fixed = fit_exact(exact)
        table = [[r["shape"], r["seg"], r["x"], f"{r['us']:.0f}",
                  f"{r['y'] - step * r['x'] - fixed:+.0f}", r["file"]] for r in exact]
        print(C.format_table(table, ["shape", "segment", "steps", "measured us",
                                     "residual us", "file"]))
        print(f"exact split: SEGMENT_SCAN_STEP_US = {step:.1f}, SEGMENT_FIXED_US = "
              f"{fixed:.0f}  (plan: {plan.SEGMENT_SCAN_STEP_US}, "
              f"{plan.SEGMENT_FIXED_US})")
    if bounded:
        for r in bounded:
            r["gpu"] = plan.bounded_gpu_us(r["lens"], r["hv"], r["seg"])
        table = [[r["shape"], r["seg"], f"{r['us']:.0f}", f"{r['gpu']:.0f}", r["file"]]
                 for r in bounded]
        print(C.format_table(table, ["shape", "segment", "measured us",
                                     "predicted GPU us", "file"]))
        host = [r["us"] for r in bounded if r["gpu"] < r["us"]]
        floor = statistics.median(host) if host else None
        print(f"bounded split: WARMUP_HOST_US = {floor if floor is None else round(floor)}"
              f"  (plan: {plan.WARMUP_HOST_US}; median of the {len(host)} rows "
              f"slower than their predicted GPU time)")
    if not exact and not bounded:
        print("no split rows of ours in the given files", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
