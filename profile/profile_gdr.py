#!/usr/bin/env python3
"""Per-kernel time breakdown of our ``chunk_gated_delta_rule`` beside peers' (torch.profiler).

For every configuration of a set (``profile/settings/<set>.csv``: columns hk, hv, layout),
ours and each peer (``--peers``, default FLA) run in a fresh worker process (shared code:
``benchmark/common.py``),
warm up (compilation, autotuning), then ``--iters`` calls are profiled. Device time is
grouped by kernel name, per call; totals and speedups follow, forward and (unless
``--skip-bwd``) backward, plus the achieved fraction of the H200 floor of our forward:
floor = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s) (``docs/gdn-math.md``).

Writes ``profile/results/<set>-<GPU>.md`` (summary and per-kernel tables), ``.csv`` (one
row per kernel) and ``.json``; prints the summary table last.

    python profile/profile_gdr.py --set develop
    python profile/profile_gdr.py --set product --skip-bwd
    python profile/profile_gdr.py --peers fla,flashqla --flashqla-path .offline-gpu/peers/flashqla
    python profile/profile_gdr.py --device cpu      # tiny CPU demo, torch backend
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shlex
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmark"))
import common as C  # noqa: E402  (benchmark/common.py, shared with the benchmark)

SETS = ("develop", "product", "varlen", "few-head")
CPU_TINY = ["2/4@1x128"]
DEFAULT_OUT = os.path.join(HERE, "results")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="profile_gdr.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 done, 1 bad arguments, 2 cannot run here "
        "(no CUDA GPU, or our flash_qla not importable).",
    )
    p.add_argument(
        "--set",
        choices=SETS,
        default="develop",
        help="configuration set: develop (B=1, T=32768, Hk=Hv in 4, 8, 16), product "
        "(the Qwen head configurations at 8k and 32k tokens), varlen (packed batches), "
        "few-head (GVA 2/4 .. 4/16 at 1x32768 and 1x8192); "
        "read from profile/settings/<set>.csv (default: develop)",
    )
    p.add_argument("--settings", metavar="CSV", help="another settings file (columns hk,hv,layout)")
    p.add_argument(
        "--shapes",
        metavar="SPEC",
        help="filter the set: comma-separated HK/HV@LAYOUT items, wildcards allowed",
    )
    p.add_argument("--skip-bwd", action="store_true", help="profile the forward only")
    p.add_argument(
        "--peers",
        default="fla",
        help="comma-separated implementations profiled beside ours, among "
        + ", ".join(C.PEERS)
        + " (see benchmark --help), or 'none' (default: fla)",
    )
    p.add_argument(
        "--flashqla-path",
        metavar="DIR",
        help="directory holding FlashQLA 0.1.3's flash_qla package, for --peers flashqla "
        "(e.g. .offline-gpu/peers/flashqla; without it that peer is 'not installed')",
    )
    p.add_argument(
        "--flashinfer-jit",
        action="store_true",
        help="let FlashInfer JIT-compile its GDN module if it is not prebuilt (more than "
        "7.5 minutes); otherwise --peers flashinfer is 'skipped' there",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default; exits with code 2 without a GPU) or cpu: one tiny "
        "configuration (" + ", ".join(CPU_TINY) + ") with our torch backend, aten ops "
        "by CPU time instead of kernels, peers other than unsplit skipped",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="profiled calls per direction (default 10; 2 on cpu)",
    )
    p.add_argument(
        "--gate",
        choices=sorted(C.GATES),
        default="model",
        help="gate recipe (see benchmark --help; default model)",
    )
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument(
        "--top",
        type=int,
        default=12,
        help="kernels listed per (config, implementation, direction) in the markdown "
        "(default 12; the CSV has all)",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=900.0,
        help="seconds before a worker is killed (default 900)",
    )
    p.add_argument(
        "--ours-backend",
        default=None,
        help="backend= for our function (default automatic; 'torch' on cpu)",
    )
    p.add_argument(
        "--ours-segment-len",
        type=C.segment_len_arg,
        default=None,
        help="segment_len= for our function: profile the segment-parallel forward "
        "(segments of this many tokens, a multiple of 64; the bounded split unless "
        "--ours-shortcut-bound 0); 'off': auto_cp=False, never split; default: the "
        "backend's automatic choice",
    )
    p.add_argument(
        "--ours-shortcut-bound",
        type=C.shortcut_bound_arg,
        default=None,
        help="segment_shortcut_bound= for our function (0: the exact split; default: "
        "the API's 2^-9)",
    )
    p.add_argument(
        "--host",
        action="store_true",
        help="list aten ops by self CPU time (host work per call) instead of kernels by "
        "device time: where a launch-bound path spends its host time",
    )
    p.add_argument(
        "--fla-tune-rep-ms",
        type=float,
        default=None,
        help="repetition time (ms) of each config FLA's autotuner times (default: "
        "Triton's 100; see benchmark --help)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default profile/results)")
    return p


def load_set(args) -> list[C.Shape]:
    if args.device == "cpu" and not args.shapes and not args.settings:
        return [C.Shape.from_key("fwd:" + k) for k in CPU_TINY]
    path = args.settings or os.path.join(HERE, "settings", f"{args.set}.csv")
    shapes = [C.Shape("fwd", hk, hv, lay).validate() for hk, hv, lay in C.read_settings_csv(path)]
    return C.select_shapes(args.shapes, ["fwd"], shapes)


def short(name: str, n: int = 90) -> str:
    name = " ".join(name.split())
    return name if len(name) <= n else name[: n - 1] + "…"


def total_us(table: dict | None) -> float | None:
    return sum(r["us"] for r in table.values()) if table else None


def host_cells(host: dict | None) -> list[str]:
    """A ``host_wall`` result as two cells: the wall per call (us) and the host syncs
    (count, first message)."""
    if not host:
        return ["–", "–"]
    first = host["syncs"][0][:60] if host["syncs"] else ""
    return [f"{host['wall_us']:.1f}", f"{len(host['syncs'])} ({first})"]


def render(meta: dict, results: list[dict], args, tag: str) -> str:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.set if args.device == 'cuda' else 'cpu'}-{tag}")
    on_gpu = args.device == "cuda" and not args.host       # kernels by device time
    host_walls = args.host and args.device == "cuda"       # measured on a GPU only
    unit, units = ("kernel", "kernels") if on_gpu else ("aten op (self CPU time)", "aten ops")
    # CSV: one row per kernel
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "shape",
                "impl",
                "direction",
                unit.split()[0],
                "us_per_call",
                "calls_per_call",
                "share",
            ]
        )
        for r in results:
            for d in ("fwd", "fwd_train", "bwd"):
                tab = r.get(d) or {}
                tot = total_us(tab) or 1.0
                for name, k in sorted(tab.items(), key=lambda x: -x[1]["us"]):
                    w.writerow(
                        [
                            r["shape"],
                            r["impl"],
                            d,
                            name,
                            f"{k['us']:.3f}",
                            f"{k['calls']:.2f}",
                            f"{k['us'] / tot:.4f}",
                        ]
                    )
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)

    by = {(r["shape"], r["impl"]): r for r in results}
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    peers = list(dict.fromkeys(r["impl"] for r in results if r["impl"] != "ours"))
    head = ["config", "tokens", "ours fwd us"]
    for p in peers:
        head += [f"{C.SHORT[p]} fwd us", f"vs {C.SHORT[p]} fwd"]
    if on_gpu:
        head += ["floor us", "ours % of floor"]
    if host_walls:
        head += ["ours fwd host wall us", "syncs (first)"]
    if not args.skip_bwd:
        head += ["ours bwd us"]
        for p in peers:
            head += [f"{C.SHORT[p]} bwd us", f"vs {C.SHORT[p]} bwd"]
        if host_walls:
            head += ["ours bwd host wall us", "bwd syncs (first)"]
    rows = []
    for key in shapes:
        s = C.Shape.from_key(key)
        o = by.get((key, "ours"), {})

        def cell(r, d):
            t = total_us(r.get(d))
            if t is not None:
                return f"{t:.1f}"
            return r.get(f"{d}_status") or r.get("status") or "–"

        def peer_cells(d, key=key, o=o):
            out = []
            for p in peers:
                r = by.get((key, p), {})
                a, b = total_us(r.get(d)), total_us(o.get(d))
                out += [cell(r, d), f"{a / b:.2f}x" if a and b else ""]
            return out

        row = [s.label, str(s.tokens), cell(o, "fwd")] + peer_cells("fwd")
        if on_gpu:
            fl = C.shape_floor(s)
            t = total_us(o.get("fwd"))
            row += [
                f"{fl['floor_ms'] * 1e3:.1f} ({fl['bound']})",
                f"{fl['floor_ms'] * 1e3 / t:.0%}" if t else "",
            ]
        if host_walls:
            row += host_cells(o.get("fwd_host"))
        if not args.skip_bwd:
            row += [cell(o, "bwd")] + peer_cells("bwd")
            if host_walls:
                row += host_cells(o.get("bwd_host"))
        rows.append(row)
    summary = C.format_table(rows, head)

    md = [
        f"# Kernel profile, set '{_set_name(args)}': {meta['device_name']}",
        "",
        "Written by `profile/profile_gdr.py`; do not edit by hand.",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- torch {meta.get('torch')}, triton {meta.get('triton')}; versions: "
        + ", ".join(f"{C.LABELS.get(k, k)} {v}" for k, v in meta.get("versions", {}).items()),
        f"- per call: {unit} time summed over {args.iters} profiled calls after "
        f"{3 if args.device == 'cuda' else 1} warm-up call(s), divided by {args.iters}; "
        f"gate '{args.gate}', "
        f"seed {args.seed}; inputs as in the benchmark (K = V = 128, bf16, initial state in, "
        "final state out)",
        (
            "- floor = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s) of the forward "
            "(gdn-math.md cost model); '% of floor' = floor / our summed kernel time"
        )
        if on_gpu
        else "- --host: the host's work per call (aten ops; the gaps between them are Python "
        "and kernel launches)"
        if args.host
        else "- CPU demo: shows the pipeline, not performance",
        "",
        "## Summary (us per call)",
        "",
        summary,
        "",
    ]
    for key in shapes:
        md += [f"## {C.Shape.from_key(key).label}", ""]
        for d in ("fwd", "fwd_train", "bwd"):
            for impl in ["ours"] + peers:
                r = by.get((key, impl))
                if not r:
                    continue
                tab = r.get(d)
                if not tab:
                    why = r.get(f"{d}_status") or r.get("reason") or r.get("status")
                    if d == "fwd" or not args.skip_bwd:
                        md += [f"{C.LABELS[impl]} {d}: {why}", ""]
                    continue
                tot = total_us(tab)
                top = sorted(tab.items(), key=lambda x: -x[1]["us"])[: args.top]
                body = [
                    [short(n), f"{k['us']:.1f}", f"{k['calls']:.1f}", f"{k['us'] / tot:.0%}"]
                    for n, k in top
                ]
                more = len(tab) - len(top)
                md += [
                    f"**{C.LABELS[impl]} {d}**: {tot:.1f} us per call, {len(tab)} {units}"
                    + (f" ({more} more in the CSV)" if more > 0 else ""),
                    "",
                    C.format_table(body, [unit, "us", "calls", "share"]),
                    "",
                ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md))
    return "\n".join(
        [f"wrote {stem}{x}" for x in (".md", ".csv", ".json")]
        + ["", f"Profile '{_set_name(args)}' ({meta['device_name']}), us per call:", summary]
    )


def _set_name(args) -> str:
    """The set's name; the CPU demo runs its own tiny configuration, not the set."""
    return args.set if args.device == "cuda" else "cpu demo"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        peers = C.parse_peers(args.peers)
        shapes = load_set(args)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.iters is None:
        args.iters = 2 if args.device == "cpu" else 10
    if args.device == "cpu":
        args.ours_backend = args.ours_backend or "torch"
        print(
            "note: --device cpu: one tiny configuration with our torch backend (not the "
            f"set '{args.set}'); peers other than unsplit need a CUDA GPU and are skipped.",
            file=sys.stderr,
        )
    scratch = C.new_scratch("profile-gdr-")
    try:
        info = C.probe_or_explain(peers, scratch, args.device, "profile")
        if info is None:
            return 2
        tag = C.gpu_tag(info["device_name"]) if args.device == "cuda" else "torch"
        avail = C.peer_availability(peers, info, args.device, args.flashqla_path,
                                    args.flashinfer_jit)
        if "flashqla" in peers:
            info.setdefault("versions", {})["flashqla"] = (
                C.flashqla_version(args.flashqla_path) or "not installed")
        spec = {
            "task": "profile",
            "device": args.device,
            "gate": args.gate,
            "seed": args.seed,
            "iters": args.iters,
            "bwd": not args.skip_bwd,
            "ours_backend": args.ours_backend,
            "ours_segment_len": args.ours_segment_len,
            "ours_shortcut_bound": args.ours_shortcut_bound,
            "host": args.host,
            "fla_tune_rep_ms": args.fla_tune_rep_ms,
            "flashqla_path": os.path.abspath(args.flashqla_path) if args.flashqla_path else None,
            "capability": info.get("capability"),
        }
        results = []
        label = "cpu demo" if args.device == "cpu" else args.set
        for shape in C.progress(shapes, desc=f"profile {label} ({args.device})"):
            for impl in ["ours"] + peers:
                why = avail.get(impl)
                if why:
                    status = "skipped" if why.startswith("skipped") else "not installed"
                    results.append({"impl": impl, "shape": shape.key, "status": status,
                                    "reason": why})
                    continue
                safe = shape.key.replace(":", "-").replace("/", "_").replace("@", "-")
                res = C.run_worker(
                    {**spec, "impl": impl, "shape": shape.key},
                    scratch,
                    f"{safe}-{impl}",
                    args.worker_timeout,
                )
                res.setdefault("impl", impl)
                res.setdefault("shape", shape.key)
                results.append(res)
        meta = {
            "device_name": info.get("device_name"),
            "torch": info.get("torch"),
            "triton": info.get("triton"),
            "versions": info.get("versions", {}),
            "set": args.set,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(
                shlex.quote(a)
                for a in [os.path.relpath(sys.argv[0], C.REPO)]
                + (sys.argv[1:] if argv is None else list(argv))
            ),
        }
        print(render(meta, results, args, tag))
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
