#!/usr/bin/env python3
"""Benchmark ``flash_qla.chunk_gated_delta_rule`` against FLA, FlashInfer and FlashQLA 0.1.3.

Every (implementation, configuration) pair is measured in a fresh worker process
(see ``benchmark/common.py``): each peer gets its own conventions, its outputs are
checked against ours on identical inputs, and its relative error is printed beside
its time. Results go to ``--out`` as ``<GPU>.md`` (the table), ``<GPU>.csv``,
``<GPU>.json`` and PNG plots; the table is printed last.

Examples (on a GPU host; on the offline H200 host of this project, after
``source .offline-gpu/activate.sh .offline-gpu``, the bundle of ``tools/prepare_offline.sh``):

    python benchmark/bench_gated_delta_rule.py --quick
    python benchmark/bench_gated_delta_rule.py --mode fwd --shapes '16/32@*' \\
        --flashqla-path .offline-gpu/peers/flashqla --resume
    python benchmark/bench_gated_delta_rule.py --device cpu        # tiny CPU demo
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402  (the shared module next to this script)

DEFAULT_OUT = os.path.join(C.HERE, "results")
CSV_FIELDS = [
    "mode",
    "hk",
    "hv",
    "layout",
    "tokens",
    "n_seqs",
    "impl",
    "status",
    "version",
    "eager_ms",
    "graph_ms",
    "b2b_ms",
    "fwdbwd_eager_ms",
    "fwdbwd_graph_ms",
    "fwdbwd_b2b_ms",
    "speedup_eager",
    "speedup_graph",
    "err_max",
    "err_o",
    "err_ht",
    "err_grads_max",
    "inputs_match",
    "floor_ms",
    "floor_frac",
    "rotations",
    "import_s",
    "first_call_s",
    "graph_status",
    "reason",
    "gate",
    "seed",
    "dense_batch",
    "shape",
    "wall_s",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_gated_delta_rule.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog=(
            "Configurations. Forward grid: Hk/Hv in "
            + ", ".join(f"{a}/{b}" for a, b in C.FWD_HEADS)
            + " x layouts "
            + ", ".join(C.FWD_LAYOUTS)
            + f" ({len(C.forward_grid())} configs). Backward grid: "
            + ", ".join(f"{a}/{b}" for a, b in C.BWD_HEADS)
            + " x "
            + ", ".join(C.BWD_LAYOUTS)
            + f" ({len(C.backward_grid())} configs). "
            "K = V = 128, bf16 q/k/v/beta, fp32 g, initial state in, final state out. "
            "varlen-a / varlen-b are two seeded random mixes of 32768 packed tokens "
            f"({C.VARLEN_MIXES['varlen-a'][1]} and {C.VARLEN_MIXES['varlen-b'][1]} sequences).\n\n"
            "Timing: triton.testing.do_bench median (it flushes L2 before every call), input "
            f"buffer sets rotated when they are smaller than {C.L2_BYTES / 1e6:.0f} MB. "
            "'eager' includes host launch overhead; 'graph' replays a CUDA graph of the same "
            "call. In bwd mode the time is the backward alone (autograd.grad on a kept "
            "forward); the table and CSV also have forward+backward (the training step), "
            "eager and as one replayed CUDA graph. Speedup = peer time / our time "
            "(> 1: ours is faster). Errors: ||peer - ours|| / ||ours|| on o and the final "
            f"state (and every gradient in bwd mode); above --tol the cell says MISMATCH.\n\n"
            "Fairness: each (implementation, configuration) runs in a fresh process, with "
            "FLA_CACHE_RESULTS=0 so that FLA autotunes on that very shape (T and B are not in "
            "its tuning key, and it caches tunings on disk by default; --fla-tuning cached "
            "keeps that default, to fit whole grids in a time budget). FLA runs with "
            "FLA_FLASH_QLA=0 (else FLA 0.5.2+ routes to flash_qla, i.e. us); FLA 0.5.0 has no "
            "GVA backward on Hopper: those rows say 'unsupported'. FlashInfer is forward only and "
            "gets alpha = exp(g), packed [T,H,D] inputs and [N,H,V,K] states. FlashQLA 0.1.3 "
            "shares our import name and is imported from --flashqla-path in its own process.\n\n"
            "Exit codes: 0 done (rows may still say error/unsupported), 2 cannot run here "
            "(no CUDA GPU, or our flash_qla not importable) or a malformed command line "
            "(argparse), 1 bad option values (--shapes, --peers, an empty selection)."
        ),
    )
    sel = p.add_argument_group("what to run")
    sel.add_argument(
        "--mode",
        choices=["fwd", "bwd", "both"],
        default="both",
        help="forward grid, backward grid or both (default: both)",
    )
    sel.add_argument(
        "--grid",
        choices=["default", "serve"],
        default="default",
        help="default: the forward and backward grids below; serve: an engine's prefill "
        "steps, packed batches of many short sequences ("
        + ", ".join(C.SERVE_LAYOUTS) + ") at Hk/Hv "
        + ", ".join(f"{a}/{b}" for a, b in C.SERVE_HEADS)
        + ", forward only, in the engine's convention: inference mode, device "
        "cu_seqlens, initial states read from and final states written into a state pool "
        "by index (ours and FlashInfer 0.7 through state_indices, FLA by a gather and a "
        "scatter around its call, both timed); peers fla, flashinfer; results tagged "
        "-serve. With --device cpu: " + ", ".join(C.CPU_SERVE),
    )
    sel.add_argument(
        "--serve-pool-dtype",
        choices=C.SERVE_POOL_DTYPES,
        default="float32",
        help="dtype of the serving grid's state pool (default float32; bfloat16 as "
        "engines that keep bf16 states)",
    )
    sel.add_argument(
        "--quick",
        action="store_true",
        help="a 5-configuration subset (" + ", ".join(C.QUICK) + "), meant to "
        "finish in under two minutes with ours and FLA",
    )
    sel.add_argument(
        "--shapes",
        metavar="SPEC",
        help="comma-separated [fwd:|bwd:]HK/HV@LAYOUT items filtering the grid, "
        "shell wildcards allowed ('16/32@*', '*@varlen-*', 'fwd:2/8@1x2048'); an "
        "item without wildcards that is not in the grid is run as a custom "
        "configuration (LAYOUT: BxT, varlen-a, varlen-b or seqs=L1+L2+...)",
    )
    sel.add_argument(
        "--min-seq-heads",
        type=int,
        default=0,
        metavar="M",
        help="keep only configurations with sequences x value heads >= M (e.g. 64: the "
        "rows where one CTA per (sequence, head) fills half the H200's SMs, issue 4's and "
        "issue 5's performance grids; --mode fwd --min-seq-heads 64 is issue 4's 57 rows)",
    )
    sel.add_argument(
        "--max-seq-heads",
        type=int,
        default=None,
        metavar="M",
        help="keep only configurations with sequences x value heads < M (the few-head "
        "rows: --max-seq-heads 64 is the complement of --min-seq-heads 64)",
    )
    sel.add_argument(
        "--list",
        action="store_true",
        help="print the selected configurations and exit (starts no worker)",
    )
    sel.add_argument(
        "--peers",
        default="fla,flashinfer,flashqla",
        help="comma-separated peers among fla, flashinfer, flashqla, unsplit, "
        "host-offsets, fla-routed, or 'none' (default: the three external ones; a peer "
        "that is absent is reported as 'not installed'). 'ours' is always the drop-in "
        "call (FLA's keywords, device cu_seqlens only, auto_cp=True); 'fla' runs FLA's "
        "Triton kernels (FLA_FLASH_QLA=0). Ours in other conventions: 'unsplit' "
        "(auto_cp=False: what the automatic split gains), 'host-offsets' (also "
        "cu_seqlens_cpu), 'fla-routed' (FLA's function with FLA's routing to flash_qla "
        "on: must match ours)",
    )
    sel.add_argument(
        "--flashqla-path",
        metavar="DIR",
        help="directory holding FlashQLA 0.1.3's flash_qla package (e.g. "
        ".offline-gpu/peers/flashqla); without it FlashQLA 0.1.3 is 'not installed'. "
        "It JIT-compiles ~4.5 min per new (Hk, Hv) on first use",
    )
    sel.add_argument(
        "--flashinfer-jit",
        action="store_true",
        help="FlashInfer 0.6.x: let it JIT-compile its GDN module if it is not prebuilt "
        "(more than 7.5 minutes on the H200 host); otherwise such a FlashInfer "
        "is reported as 'skipped'. (0.7.x compiles its CuTe-DSL kernels in each "
        "worker process on first call, seconds per kernel: --worker-per mode pays "
        "that once)",
    )
    sel.add_argument(
        "--flashinfer-cp",
        choices=sorted(C.FLASHINFER_CP),
        default="auto",
        help="FlashInfer 0.7.x's use_cp: auto (default, its own choice: the "
        "context-parallel kernels when sequences x heads is below half the SMs), on, "
        "off. 0.6.x has no such option: anything but auto reports it as 'not installed'",
    )
    sel.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default; exits with code 2 when there is no GPU) or cpu: a "
        "tiny set (" + ", ".join(C.CPU_TINY) + ") with our torch backend; of the "
        "peers only 'unsplit' runs there",
    )
    inp = p.add_argument_group("inputs")
    inp.add_argument(
        "--gate",
        choices=sorted(C.GATES),
        default="model",
        help="gate recipe: " + "; ".join(f"{k}: {v}" for k, v in C.GATES.items()),
    )
    inp.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    inp.add_argument(
        "--dense-batch",
        action="store_true",
        help="pass uniform BxT layouts with B > 1 as dense [B, T] tensors instead "
        "of packed [1, B*T] + cu_seqlens (FlashInfer is always packed)",
    )
    tim = p.add_argument_group("timing")
    tim.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (default 25)")
    tim.add_argument(
        "--rep-ms", type=float, default=100.0, help="do_bench repetition time (default 100)"
    )
    tim.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph column")
    tim.add_argument(
        "--fla-tune-rep-ms",
        type=float,
        default=None,
        help="repetition time (ms; warm-up a quarter of it) of each config FLA's Triton "
        "autotuner times on each shape (default: Triton's 100 / 25). Lower it to fit many "
        "shapes in a time budget: FLA still tunes on every shape, over the same configs",
    )
    tim.add_argument(
        "--fla-tuning",
        choices=["per-shape", "cached"],
        default="per-shape",
        help="per-shape (default): FLA autotunes on every shape (FLA_CACHE_RESULTS=0: "
        "~40-55 s per forward shape on the H200); cached: FLA's own default, Triton's "
        "on-disk autotune cache, so a shape whose tuning key (heads, dims, not T or B) "
        "was tuned before reuses that tuning: whole grids fit a device call, FLA may run "
        "a config tuned on another length (the report says which)",
    )
    tim.add_argument(
        "--worker-per",
        choices=["config", "heads", "mode"],
        default="config",
        help="config (default): every (implementation, configuration) in a fresh "
        "process; heads: one process per implementation measures the consecutive "
        "configurations of one mode and Hk/Hv in turn (imports, kernel loads and FLA's "
        "tuning paid once per group: a whole grid in a fraction of the time; the "
        "first-call columns then come from each group's first configuration only); "
        "mode: the same over the consecutive configurations of one mode, any heads "
        "(the peers' imports, ~12 s for FlashQLA 0.1.3 on the H200, paid once per run)",
    )
    tim.add_argument(
        "--cold-first-call",
        action="store_true",
        help="also measure first-call latency with empty Triton, TileLang and "
        "XDG kernel caches (one extra worker per implementation on the first configuration; "
        "minutes for TileLang-based ones)",
    )
    tim.add_argument(
        "--worker-timeout",
        type=float,
        default=900.0,
        help="seconds before a worker is killed and reported as 'timeout' (default 900)",
    )
    tim.add_argument(
        "--ours-backend",
        default=None,
        help="backend= passed to our chunk_gated_delta_rule (default: automatic on "
        "cuda, 'torch' on cpu)",
    )
    p.add_argument(
        "--ours-segment-len",
        type=C.segment_len_arg,
        default=None,
        help="segment_len= passed to our chunk_gated_delta_rule: the segment-parallel "
        "forward with segments of this many tokens (a multiple of 64; the bounded split "
        "unless --ours-shortcut-bound 0 asks for the exact one); 'off': auto_cp=False "
        "(never split); default: the backend's automatic choice; use --tag to keep its "
        "results apart",
    )
    p.add_argument(
        "--ours-shortcut-bound",
        type=C.shortcut_bound_arg,
        default=None,
        help="segment_shortcut_bound= passed to our chunk_gated_delta_rule (0: the split "
        "never drops a transition; default: the API's 2^-9)",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--out", default=DEFAULT_OUT, help="output directory (default: benchmark/results)"
    )
    out.add_argument(
        "--tag",
        help="file-name stem (default: the GPU name, e.g. H200, plus "
        "-gate-<recipe> when --gate is not 'model'; 'cpu' on --device cpu)",
    )
    out.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows of an existing <tag>.json in --out and run only the "
        "missing or failed (implementation, configuration) pairs: lets the full "
        "grid be measured in several shorter commands",
    )
    out.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no new configuration after this many seconds and report the ones "
        "done (fits a run into a time-limited GPU lease; combine with --resume)",
    )
    out.add_argument(
        "--tol",
        type=float,
        default=C.TOL,
        help=f"relative error above which a peer is flagged MISMATCH (default {C.TOL})",
    )
    out.add_argument(
        "--from-json",
        metavar="FILE",
        help="render the table, markdown, CSV and plots from a results JSON "
        "written earlier (no measurement; e.g. where matplotlib is installed)",
    )
    out.add_argument(
        "--keep-scratch",
        action="store_true",
        help="keep the worker scratch directory (specs, logs, reference tensors)",
    )
    return p


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def shape_row(shape: C.Shape) -> dict:
    return {
        "shape": shape.key,
        "mode": shape.mode,
        "hk": shape.hk,
        "hv": shape.hv,
        "layout": shape.layout,
        "tokens": shape.tokens,
        "n_seqs": shape.n_seqs,
        "floor_ms": C.shape_floor(shape)["floor_ms"] if shape.mode == "fwd" else None,
    }


def flatten(shape: C.Shape, impl: str, res: dict, args) -> dict:
    row = {
        **shape_row(shape),
        "impl": impl,
        "gate": args.gate,
        "seed": args.seed,
        "dense_batch": bool(args.dense_batch),
    }
    for k in (
        "status",
        "reason",
        "version",
        "eager_ms",
        "graph_ms",
        "b2b_ms",
        "fwdbwd_eager_ms",
        "fwdbwd_graph_ms",
        "fwdbwd_b2b_ms",
        "graph_status",
        "fwdbwd_graph_status",
        "rotations",
        "import_s",
        "first_call_s",
        "inputs_match",
        "wall_s",
        "log_tail",
    ):
        if res.get(k) is not None:
            row[k] = res[k]
    err = res.get("err")
    if err:
        row["err_detail"] = err
        row["err_o"] = err.get("o")
        row["err_ht"] = err.get("ht")
        grads = [v for n, v in err.items() if n in C.GRAD_NAMES]
        row["err_grads_max"] = max(grads) if grads else None
        row["err_max"] = max(err.values())
    return row


def run(args, shapes: list[C.Shape], peers: list[str], info: dict, rows: dict, scratch: str):
    env = {"device": args.device, "capability": info.get("capability"),
           "fla_version": info.get("versions", {}).get("fla", ""),
           "serve": args.grid == "serve"}
    avail = C.peer_availability(peers, info, args.device, args.flashqla_path,
                                args.flashinfer_jit)
    common_spec = {
        "task": "bench",
        "device": args.device,
        "gate": args.gate,
        "seed": args.seed,
        "dense_batch": args.dense_batch,
        "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms,
        "graphs": not args.no_graphs,
        "flashqla_path": os.path.abspath(args.flashqla_path) if args.flashqla_path else None,
        "ours_backend": args.ours_backend,
        "ours_segment_len": args.ours_segment_len,
        "ours_shortcut_bound": args.ours_shortcut_bound,
        "fla_tune_rep_ms": args.fla_tune_rep_ms,
        "fla_tuning": args.fla_tuning,
        "flashinfer_cp": args.flashinfer_cp,
        "capability": info.get("capability"),
        "serve": args.grid == "serve",
        "serve_pool_dtype": args.serve_pool_dtype,
    }
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    done = lambda r: bool(r) and r.get("status") in ("ok", "unsupported")  # noqa: E731
    groups = _worker_groups(shapes, args.worker_per)
    bar = C.progress(groups, desc=f"benchmark ({args.device}, {len(shapes)} configs)")
    for group in bar:
        if deadline is not None and time.monotonic() > deadline:
            print(f"note: --deadline-s {args.deadline_s:g} reached; reporting the "
                  f"configurations done so far", file=sys.stderr)
            break
        refs = {s.key: os.path.join(scratch, f"{_safe(s.key)}.ours.pt") for s in group}
        todo = {}  # impl -> shapes it still has to run
        ref_only = set()  # shapes whose ours row (kept by --resume) is not to be replaced
        for shape in group:
            need = [i for i in ["ours"] + peers if not done(rows.get((shape.key, i)))]
            if (
                need
                and "ours" not in need
                and any(not (C.static_unsupported(i, shape, env) or avail.get(i)) for i in need)
            ):
                need.insert(0, "ours")  # a peer to (re)measure needs ours' outputs beside it
                ref_only.add(shape.key)
            for impl in need:
                why = C.static_unsupported(impl, shape, env) or (
                    avail.get(impl) if impl != "ours" else None
                )
                if why:
                    rows[(shape.key, impl)] = _not_run_row(shape, impl, why, args)
                else:
                    todo.setdefault(impl, []).append(shape)
        for impl in [i for i in ["ours"] + peers if i in todo]:   # ours first: the refs
            batch = todo[impl]
            bar.set_postfix_str(f"{batch[0].label}{' ...' if len(batch) > 1 else ''} "
                                f"{C.SHORT[impl]}")
            spec = {**common_spec, "impl": impl}
            if deadline is not None:  # a batch starts no item past the deadline either
                spec["deadline_epoch"] = time.time() + deadline - time.monotonic()
            results = C.run_batch_worker(
                spec,
                [{"shape": s.key, "ref_path": refs[s.key],
                  **({"ref_only": True} if impl == "ours" and s.key in ref_only else {})}
                 for s in batch],
                scratch,
                f"{_safe(batch[0].key)}-{impl}" + (f"-x{len(batch)}" if len(batch) > 1 else ""),
                args.worker_timeout * len(batch),
            )
            for shape, res in zip(batch, results):
                if impl == "ours" and shape.key in ref_only:
                    # run only as the peers' reference: the row measured earlier (and
                    # kept by --resume) stays, so a peer can be measured in a later
                    # call, even with --ours-backend torch as the reference there
                    rows[(shape.key, impl)]["reference_rerun"] = {
                        "status": res.get("status"), "ours_backend": args.ours_backend or "auto"}
                    continue
                rows[(shape.key, impl)] = flatten(shape, impl, res, args)
        if not args.keep_scratch:
            for path in refs.values():
                if os.path.exists(path):
                    os.remove(path)
    bar.close()


def _safe(key: str) -> str:
    name = key.replace(":", "-").replace("/", "_").replace("@", "-")
    if len(name) > 120:           # a long seqs=... layout: keep the file name under the limit
        import hashlib

        name = f"{name[:80]}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    return name


def _worker_groups(shapes: list[C.Shape], worker_per: str) -> list[list[C.Shape]]:
    """Shapes measured by one worker process per implementation: each alone
    (``config``, the fresh-process default), or consecutive shapes of the same mode and
    heads together (``heads``: one import and one peer tuning per group), or of the
    same mode (``mode``: one import per run and mode)."""
    if worker_per == "config":
        return [[s] for s in shapes]
    key = ((lambda s: s.mode) if worker_per == "mode"
           else (lambda s: (s.mode, s.hk, s.hv)))
    groups: list[list[C.Shape]] = []
    for s in shapes:
        if groups and key(groups[-1][0]) == key(s):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _not_run_row(shape: C.Shape, impl: str, why: str, args) -> dict:
    status = next(
        (w for w in ("not installed", "unsupported", "skipped") if why.startswith(w)),
        "unsupported",
    )
    return {
        **shape_row(shape),
        "impl": impl,
        "status": status,
        "reason": why,
        "gate": args.gate,
        "seed": args.seed,
    }


def _timing_line(meta: dict) -> str:
    """The report's timing line on a GPU: how the workers ran (``--worker-per``) and how
    FLA was tuned (``--fla-tuning``)."""
    per_config = meta.get("worker_per", "config") == "config"
    group = ("mode" if meta.get("worker_per") == "mode" else "mode and Hk/Hv group")
    workers = ("each (implementation, config) in a fresh process, FLA " if per_config else
               f"one process per (implementation, {group}) measuring the "
               "group's configs in turn, FLA (its tuning key has no T or B) ")
    if meta.get("fla_tuning", "per-shape") == "per-shape":
        first = ("the group's first config" if group != "mode"
                 else "the first config of each Hk/Hv in it")
        tuning = ("autotuned on that shape" if per_config
                  else f"autotuned on {first}") + " (FLA_CACHE_RESULTS=0"
    else:
        tuning = ("with its on-disk autotune cache (FLA_CACHE_RESULTS=1: a shape reuses the "
                  "tuning of an earlier one with the same heads and dims, any T / B")
    rep = f"; {meta['fla_tune_rep_ms']:g} ms per config" if meta.get("fla_tune_rep_ms") else ""
    return ("- timing: triton.testing.do_bench median (L2 flushed before each call; input "
            "buffers rotated below 60 MB); eager includes host launch overhead, graph = "
            "CUDA-graph replay; " + workers + tuning + rep + ")")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def cold_first_call(args, shape: C.Shape, impls: list[str], scratch: str) -> dict:
    """First call with empty Triton/TileLang kernel caches, one fresh worker per impl."""
    out = {}
    for impl in impls:
        cache = C.new_scratch(f"cold-{impl}-")
        env = {
            "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
            "TILELANG_CACHE_DIR": os.path.join(cache, "tilelang"),
            "XDG_CACHE_HOME": os.path.join(cache, "xdg"),
            "FLA_CACHE_RESULTS": "0",
        }
        spec = {
            "task": "bench",
            "impl": impl,
            "shape": shape.key,
            "device": args.device,
            "gate": args.gate,
            "seed": args.seed,
            "dense_batch": args.dense_batch,
            "warmup_ms": 1,
            "rep_ms": 1,
            "graphs": False,
            "ours_backend": args.ours_backend,
            "ours_segment_len": args.ours_segment_len,
            "ours_shortcut_bound": args.ours_shortcut_bound,
            "flashinfer_cp": args.flashinfer_cp,
            "flashqla_path": os.path.abspath(args.flashqla_path) if args.flashqla_path else None,
            "ref_path": os.path.join(cache, "none.pt"),
            "capability": None,
        }
        res = C.run_worker(spec, scratch, f"cold-{impl}", args.worker_timeout, env)
        out[impl] = {
            "shape": shape.key,
            "status": res.get("status"),
            "first_call_s": res.get("first_call_s"),
            "reason": res.get("reason"),
        }
        shutil.rmtree(cache, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------


def _f(x, nd=3):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _speedup(peer: dict, ours: dict, col: str):
    a, b = peer.get(col), ours.get(col)
    return a / b if a and b else None


def err_cell(row: dict, tol: float) -> str:
    if row.get("status") != "ok":
        return ""
    if row.get("inputs_match") is False:
        return "INPUTS DIFFER"
    e = row.get("err_max")
    if e is None:
        return "no ref"
    if not math.isfinite(e) or e > tol:
        return f"MISMATCH {e:.1e}"
    return f"{e:.1e}"


def ms_cell(row: dict | None) -> str:
    if not row:
        return ""
    if row.get("status") != "ok":
        return str(row.get("status", "?"))
    return f"{_f(row.get('eager_ms'))} / {_f(row.get('graph_ms'))}"


def table_rows(
    rows: dict, mode: str, peers: list[str], tol: float, floor: bool = True
) -> tuple[list, list]:
    headers = ["config", "tokens", "ours ms eager / graph"]
    floor = floor and mode == "fwd"
    both = mode == "bwd"          # the backward table also shows forward + backward (eager)
    b2b = "fwdbwd_b2b_ms" if both else "b2b_ms"      # back to back: the forward's, or the
    step = "fwd+bwd " if both else ""                 # training step's (not the backward's)
    if floor:
        headers.append("floor ms (ours %)")
    if both:
        headers.append("ours fwd+bwd ms eager / graph")
    headers.append(f"ours {step}ms back-to-back")
    for p in peers:
        headers += [f"{C.SHORT[p]} ms", f"vs {C.SHORT[p]}", f"{C.SHORT[p]} err"]
        if both:
            headers += [f"{C.SHORT[p]} fwd+bwd ms", f"vs {C.SHORT[p]} fwd+bwd"]
        headers.append(f"vs {C.SHORT[p]} {step}back-to-back")
    # fwd+bwd: the training step eager (host launches included) / replayed as one CUDA
    # graph (device time only: the GPU-bound comparison, free of the host's speed);
    # back-to-back: calls issued continuously, the stable eager measure (host included)
    out = []
    for key in ordered_shapes(rows, mode):
        shape = C.Shape.from_key(key)
        ours = rows.get((key, "ours"), {})
        r = [shape.label, str(shape.tokens), ms_cell(ours)]
        if floor:
            fl = ours.get("floor_ms") or C.shape_floor(shape)["floor_ms"]
            frac = fl / ours["eager_ms"] if ours.get("eager_ms") else None
            r.append(f"{fl:.3f} ({frac:.0%})" if frac else f"{fl:.3f}")
        if both:
            r.append(_pair(ours, "fwdbwd_eager_ms", "fwdbwd_graph_ms"))
        r.append(_ms(ours.get(b2b)))
        for p in peers:
            pr = rows.get((key, p))
            good = bool(pr) and pr.get("status") == "ok" and ours.get("status") == "ok"
            se, sg = (
                (_speedup(pr, ours, "eager_ms"), _speedup(pr, ours, "graph_ms"))
                if good
                else (None, None)
            )
            sp = _ratio_pair(se, sg)
            r += [ms_cell(pr), sp, err_cell(pr or {}, tol)]
            if both:
                sfb, sfg = ((_speedup(pr, ours, "fwdbwd_eager_ms"),
                             _speedup(pr, ours, "fwdbwd_graph_ms")) if good else (None, None))
                r += [_pair(pr or {}, "fwdbwd_eager_ms", "fwdbwd_graph_ms"),
                      _ratio_pair(sfb, sfg)]
            sb = _speedup(pr, ours, b2b) if good else None
            r.append("" if sb is None else f"{sb:.2f}x")
        out.append(r)
    return headers, out


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _ratio_pair(eager: float | None, graph: float | None) -> str:
    """``eager / graph`` speedup cell ("" without an eager speedup, "–" for the graph)."""
    return "" if eager is None else f"{eager:.2f}x / {(f'{graph:.2f}x' if graph else '–')}"


def _pair(row: dict, eager: str, graph: str) -> str:
    """``eager / graph`` ms cell of ``row`` ("–" for a missing value)."""
    return f"{_ms(row.get(eager))} / {_ms(row.get(graph))}"


def ordered_shapes(rows: dict, mode: str) -> list[str]:
    grid = [s.key for s in (C.forward_grid() if mode == "fwd" else C.backward_grid())]
    keys = sorted({k for k, _ in rows if k.startswith(mode + ":")})
    return [k for k in grid if k in keys] + [k for k in keys if k not in grid]


def peers_in(rows: dict) -> list[str]:
    present = {i for _, i in rows}
    return [p for p in C.PEERS if p in present]


def first_call_table(rows: dict, cold: dict) -> tuple[list, list]:
    headers = [
        "implementation",
        "version",
        "import s",
        "first call s (first config)",
        "first call s (median)",
        "cold caches s",
    ]
    out = []
    for impl in ["ours"] + list(C.PEERS):
        rs = [r for (k, i), r in rows.items() if i == impl and r.get("first_call_s") is not None]
        if not rs and impl not in cold:
            continue
        rs_sorted = sorted(rs, key=lambda r: r.get("order", 0))
        fc = sorted(r["first_call_s"] for r in rs)
        med = fc[len(fc) // 2] if fc else None
        c = cold.get(impl, {})
        out.append(
            [
                C.LABELS[impl],
                rs[0].get("version", "") if rs else "",
                _f(rs_sorted[0].get("import_s"), 2) if rs else "",
                (
                    f"{rs_sorted[0]['first_call_s']:.2f} "
                    f"({C.Shape.from_key(rs_sorted[0]['shape']).label})"
                    if rs
                    else ""
                ),
                _f(med, 2),
                _f(c.get("first_call_s"), 1)
                if c.get("status") == "ok"
                else (c.get("status") or "not measured"),
            ]
        )
    return headers, out


def notes(rows: dict) -> list[str]:
    seen: dict[str, int] = {}
    for (_key, impl), r in rows.items():
        if r.get("status") != "ok":
            msgs = [f"{C.LABELS[impl]}: {r.get('reason') or r.get('status')}"]
        else:
            msgs = [f"{C.LABELS[impl]} {col}: {r[key]}"
                    for key, col in (("graph_status", "graph column"),
                                     ("fwdbwd_graph_status", "fwd+bwd graph column"))
                    if r.get(key) not in (None, "ok", "off", "n/a (cpu)")]
        for msg in msgs:
            seen[msg] = seen.get(msg, 0) + 1
    return [f"{m} ({n} config{'s' if n > 1 else ''})" for m, n in sorted(seen.items())]


def render(meta: dict, rows: dict, out_dir: str, tag: str, tol: float) -> str:
    """Write <tag>.csv, <tag>.json, <tag>.md and the PNGs; return the text table."""
    os.makedirs(out_dir, exist_ok=True)
    peers = peers_in(rows)
    # speedups into the rows (for the CSV)
    for (key, impl), r in rows.items():
        ours = rows.get((key, "ours"), {})
        if impl != "ours" and r.get("status") == "ok":
            r["speedup_eager"] = _speedup(r, ours, "eager_ms")
            r["speedup_graph"] = _speedup(r, ours, "graph_ms")
        if impl == "ours" and r.get("floor_ms") and r.get("eager_ms"):
            r["floor_frac"] = r["floor_ms"] / r["eager_ms"]
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump({"meta": meta, "results": list(rows.values())}, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"{tag}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows.values():
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    pngs = plots(rows, peers, out_dir, tag)

    on_gpu = meta.get("device_name") not in (None, "cpu")
    timing = _timing_line(meta) if on_gpu else (
        "- timing: CPU demo with our torch backend: median wall-clock ms of a few calls "
        "(no CUDA graphs, no GPU peers, no H200 floor); it shows the pipeline, not performance"
    )
    text, md = (
        [],
        [
            f"# chunk_gated_delta_rule benchmark: {meta.get('device_name')}",
            "",
            "Written by `benchmark/bench_gated_delta_rule.py`; do not edit by hand.",
            "",
            f"- command: `{meta.get('command')}`",
            f"- date: {meta.get('date')}; git: {meta.get('git')}",
            f"- torch {meta.get('torch')}, triton {meta.get('triton')}, "
            f"python {meta.get('python')}",
            "- versions: "
            + ", ".join(
                f"{C.LABELS.get(k, k)} {v}" for k, v in (meta.get("versions") or {}).items()
            ),
            f"- inputs: K = V = 128, bf16 q/k/v/beta, fp32 g, L2-normalised q/k, "
            f"beta = sigmoid(randn), initial state in, final state out; gate "
            f"'{meta.get('gate')}': {C.GATES.get(meta.get('gate'), '')}; seed {meta.get('seed')}",
            timing,
            f"- 'vs X' = X's time / ours (> 1: ours faster), eager / graph; back-to-back = "
            f"20 calls (in bwd mode: training steps) issued without a flush or sync between "
            f"them, per call, median of 3 runs: the stable eager measure of a host-bound call "
            f"(one do_bench median of those swings); 'err' = max "
            f"relative L2 error vs ours over o, final state (and all gradients in bwd); "
            f"MISMATCH above {tol:g}",
            "- floor = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s), gdn-math.md cost model; "
            "(ours %) = floor / our eager time",
            *([f"- serving grid: inference mode, device cu_seqlens, states in a "
               f"{meta.get('serve_pool_dtype')} pool of 2N + 1 rows at permuted slots (ours, "
               f"FlashInfer 0.7: state_indices, in place; FLA: gather + call + scatter, "
               f"timed together); 'err' compares o and the pool rows written"]
              if meta.get("grid") == "serve" else []),
            "",
        ],
    )
    for mode, title in (("fwd", "Forward"), ("bwd", "Backward (backward pass alone)")):
        if not ordered_shapes(rows, mode):
            continue
        h, body = table_rows(rows, mode, peers, tol, floor=on_gpu)
        md += [f"## {title}", "", C.format_table(body, h, "github"), ""]
        md += [
            f"![{os.path.basename(p)[:-4]}]({os.path.basename(p)})"
            for p in pngs
            if f"-{mode}-" in p
        ] + [""]
        text += [f"{title}, ms (eager / graph):", C.format_table(body, h, "github"), ""]
    h, body = first_call_table(rows, meta.get("cold_first_call") or {})
    md += [
        "## First-call latency (fresh process: import + compilation/autotuning + first run)",
        "",
        C.format_table(body, h, "github"),
        "",
        "'first config' is the first worker of the run (kernel caches as found on disk); "
        "'cold caches' empties the Triton and TileLang caches (--cold-first-call).",
        "",
    ]
    text += ["First-call latency, s:", C.format_table(body, h, "github"), ""]
    nts = notes(rows)
    if nts:
        md += ["## Notes", ""] + [f"- {n}" for n in nts] + [""]
        text += ["Notes:"] + [f"  - {n}" for n in nts] + [""]
    with open(os.path.join(out_dir, f"{tag}.md"), "w") as f:
        f.write("\n".join(md))
    files = [f"{tag}.md", f"{tag}.csv", f"{tag}.json"] + [os.path.basename(p) for p in pngs]
    return "\n".join([f"wrote {os.path.join(out_dir, x)}" for x in files] + [""] + text)


def plots(rows: dict, peers: list[str], out_dir: str, tag: str) -> list[str]:
    mpl = C.need("matplotlib", purpose="PNG plots skipped; rerun with --from-json to make them")
    if mpl is None:
        return []
    mpl.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (mpl.ticker below)

    written = []
    colour = {impl: f"C{i}" for i, impl in enumerate(["ours", *C.PEERS])}
    for mode in ("fwd", "bwd"):
        keys = ordered_shapes(rows, mode)
        if not keys:
            continue
        ok = lambda k, i: rows.get((k, i), {}).get("status") == "ok"  # noqa: E731
        impls = [i for i in ["ours"] + peers if any(ok(k, i) for k in keys)]
        labels = [C.Shape.from_key(k).label for k in keys]
        width = max(8.0, 0.32 * len(keys) * max(1, len(impls)) / 2 + 3)
        fig, axes = plt.subplots(2, 1, figsize=(width, 9), sharex=True)
        for ax, col, name in ((axes[0], "eager_ms", "eager"), (axes[1], "graph_ms", "CUDA graph")):
            bw = 0.8 / max(1, len(impls))
            for j, impl in enumerate(impls):
                ys = [rows[(k, impl)].get(col) if ok(k, impl) else None for k in keys]
                xs = [i + (j - (len(impls) - 1) / 2) * bw for i in range(len(keys))]
                ax.bar(
                    [x for x, y in zip(xs, ys) if y],
                    [y for y in ys if y],
                    bw,
                    color=colour[impl],
                    label=C.LABELS[impl],
                )
            ax.set_yscale("log")
            ax.set_ylabel(f"{name} ms (log)")
            ax.grid(axis="y", which="both", alpha=0.3)
            ax.legend(fontsize=8)
        axes[1].set_xticks(range(len(keys)))
        axes[1].set_xticklabels(labels, rotation=90, fontsize=7)
        fig.suptitle(f"chunk_gated_delta_rule {mode} latency ({tag})")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{tag}-{mode}-latency.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        vs = [p for p in impls if p != "ours"]
        if not vs:
            continue
        fig, ax = plt.subplots(figsize=(width, 5))
        bw = 0.8 / (2 * len(vs))
        for j, p in enumerate(vs):
            for m, (col, hatch) in enumerate((("eager_ms", None), ("graph_ms", "//"))):
                ys = [
                    _speedup(rows.get((k, p), {}), rows.get((k, "ours"), {}), col)
                    if rows.get((k, p), {}).get("status") == "ok"
                    else None
                    for k in keys
                ]
                off = (2 * j + m - (2 * len(vs) - 1) / 2) * bw
                xs = [i + off for i in range(len(keys))]
                if not any(ys):
                    continue
                # bars grow from 1x: up = ours faster, down = ours slower
                ax.bar(
                    [x for x, y in zip(xs, ys) if y],
                    [y - 1 for y in ys if y],
                    bw,
                    bottom=1.0,
                    hatch=hatch,
                    color=colour[p],
                    alpha=1.0 if m == 0 else 0.55,
                    label=f"vs {C.LABELS[p]} ({'eager' if m == 0 else 'graph'})",
                )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        fmt = mpl.ticker.FuncFormatter(lambda v, _: f"{v:g}x")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("speedup = peer ms / ours ms (log; > 1: ours faster)")
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(labels, rotation=90, fontsize=7)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle(f"chunk_gated_delta_rule {mode}: speedup of ours ({tag})")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{tag}-{mode}-speedup.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def load_rows(path: str) -> tuple[dict, dict]:
    with open(path) as f:
        data = json.load(f)
    return data.get("meta", {}), {(r["shape"], r["impl"]): r for r in data.get("results", [])}


def git_rev() -> str:
    """``git describe --always --dirty`` of the checkout ("-dirty": the tree that ran is
    not that commit, e.g. a copy on a remote GPU host), plus a fingerprint of the package
    sources that actually ran (:func:`common.source_fingerprint`)."""
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=C.REPO,
            text=True,
            capture_output=True,
            timeout=10,
        ).stdout.strip() or "uncommitted"
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return f"{rev} (sources {C.source_fingerprint()})"


# --------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        meta, rows = load_rows(args.from_json)
        out = (
            args.out
            if args.out != DEFAULT_OUT
            else os.path.dirname(os.path.abspath(args.from_json))
        )
        tag = args.tag or os.path.splitext(os.path.basename(args.from_json))[0]
        print(render(meta, rows, out, tag, args.tol))
        return 0

    modes = ["fwd", "bwd"] if args.mode == "both" else [args.mode]
    serve = args.grid == "serve"
    if serve:
        modes = ["fwd"]                     # engines prefill without autograd
    try:
        peers = C.parse_peers(args.peers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.grid == "serve" and args.peers == build_parser().get_default("peers"):
        peers = [p for p in peers if p in C.SERVE_IMPLS]     # the peers it has a pool call for
    if args.device == "cpu" and args.quick and not args.shapes:
        print("note: --quick is the GPU subset; on the CPU the tiny CPU set runs", file=sys.stderr)
    keys = (
        C.CPU_TINY if args.device == "cpu" and not args.shapes else C.QUICK if args.quick else None
    )
    if serve:
        keys = C.CPU_SERVE if args.device == "cpu" and not args.shapes else None
    base = ([C.Shape.from_key(k) for k in keys] if keys
            else C.serve_grid() if serve else C.forward_grid() + C.backward_grid())
    try:
        shapes = C.select_shapes(args.shapes, modes, base)
        shapes = [s for s in shapes if args.min_seq_heads <= s.n_seqs * s.hv
                  and (args.max_seq_heads is None or s.n_seqs * s.hv < args.max_seq_heads)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not shapes:
        print("error: no configuration selected", file=sys.stderr)
        return 1
    if args.list:
        for s in shapes:
            print(f"{s.key:28s} tokens={s.tokens:6d} seqs={s.n_seqs:3d}")
        return 0
    if args.device == "cpu":
        args.ours_backend = args.ours_backend or "torch"
        print(
            "note: --device cpu: a tiny set with our torch backend; FLA (Triton), FlashInfer "
            "and FlashQLA 0.1.3 need a CUDA GPU and are skipped.",
            file=sys.stderr,
        )

    scratch = C.new_scratch("bench-gdr-")
    try:
        info = C.probe_or_explain(peers, scratch, args.device, "benchmark")
        if info is None:
            return 2
        tag = args.tag or (C.gpu_tag(info["device_name"]) if args.device == "cuda" else "cpu")
        if not args.tag and args.gate != "model":
            tag += f"-gate-{args.gate}"
        if not args.tag and serve:
            tag += "-serve" + ("" if args.serve_pool_dtype == "float32"
                               else f"-pool-{args.serve_pool_dtype}")
        versions = dict(info.get("versions", {}))
        if "flashqla" in peers:
            versions["flashqla"] = C.flashqla_version(args.flashqla_path) or "not installed"
        rows: dict = {}
        json_path = os.path.join(args.out, f"{tag}.json")
        if args.resume and os.path.exists(json_path):
            old_meta, rows = load_rows(json_path)
            # peers measured by an earlier call and not probed by this one keep their version
            versions = {**(old_meta.get("versions") or {}), **versions}
            print(f"note: resuming from {json_path} ({len(rows)} rows)", file=sys.stderr)
        # A time-limited lease ends with SIGTERM (``timeout``): report what is done.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            run(args, shapes, peers, info, rows, scratch)
        except KeyboardInterrupt:
            print("note: interrupted; reporting the configurations done so far", file=sys.stderr)
        for i, r in enumerate(rows.values()):
            r.setdefault("order", i)
        cold = {}
        if args.cold_first_call:
            done = [
                i
                for i in ["ours"] + peers
                if rows.get((shapes[0].key, i), {}).get("status") == "ok"
            ]
            cold = cold_first_call(args, shapes[0], done, scratch)
        meta = {
            "device_name": info.get("device_name"),
            "capability": info.get("capability"),
            "torch": info.get("torch"),
            "triton": info.get("triton"),
            "python": info.get("python"),
            "versions": versions,
            "gate": args.gate,
            "seed": args.seed,
            "dense_batch": args.dense_batch,
            "fla_tune_rep_ms": args.fla_tune_rep_ms,
            "fla_tuning": args.fla_tuning,
            "worker_per": args.worker_per,
            "grid": args.grid,
            "serve_pool_dtype": args.serve_pool_dtype if args.grid == "serve" else None,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "git": git_rev(),
            "command": " ".join(
                shlex.quote(a)
                for a in [os.path.relpath(sys.argv[0], C.REPO)]
                + (sys.argv[1:] if argv is None else list(argv))
            ),
            "cold_first_call": cold,
        }
        print(render(meta, rows, args.out, tag, args.tol))
        return 0
    finally:
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"note: scratch kept in {scratch}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
