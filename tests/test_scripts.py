"""CPU smoke tests of the benchmark and profile scripts (issue 7).

Both scripts run end to end with ``--device cpu`` on their tiny set (our torch backend,
peers skipped) in a subprocess, into a temporary ``--out``; the files they promise must
exist. The pure planning helpers of ``benchmark/common.py`` are checked without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmark", "bench_gated_delta_rule.py")
PROFILE = os.path.join(REPO, "profile", "profile_gdr.py")
TUNE = os.path.join(REPO, "benchmark", "tune_chunk_fwd.py")
sys.path.insert(0, os.path.join(REPO, "benchmark"))
import common as C  # noqa: E402


def _ours_reason() -> str | None:
    """Why our torch backend cannot be driven yet, or None."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not installed ({e})"
    try:
        C.import_ours()
    except Exception as e:  # noqa: BLE001 - any import failure means "not there yet"
        return f"flash_qla.chunk_gated_delta_rule is not importable yet ({type(e).__name__}: {e})"
    return None


needs_ours = pytest.mark.skipif(_ours_reason() is not None, reason=str(_ours_reason()))


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@needs_ours
def test_benchmark_cpu_writes_its_files(tmp_path):
    p = _run([BENCH, "--device", "cpu", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("cpu.md", "cpu.csv", "cpu.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "cpu.json").read_text())
    ours = [r for r in data["results"] if r["impl"] == "ours"]
    assert {r["mode"] for r in ours} == {"fwd", "bwd"}
    assert all(r["status"] == "ok" and r["eager_ms"] > 0 for r in ours), ours
    # back to back: the forward's calls in fwd mode, the training steps in bwd mode
    assert all(r["b2b_ms" if r["mode"] == "fwd" else "fwdbwd_b2b_ms"] > 0 for r in ours), ours
    assert all(r["status"] == "skipped" for r in data["results"] if r["impl"] != "ours")
    assert "Forward" in p.stdout.splitlines()[-1] or "|" in p.stdout  # the table is printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "cpu-fwd-latency.png").stat().st_size > 0


@needs_ours
def test_profile_cpu_writes_its_files(tmp_path):
    p = _run([PROFILE, "--device", "cpu", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("cpu-torch.md", "cpu-torch.csv", "cpu-torch.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "cpu-torch.json").read_text())
    ours = [r for r in data["results"] if r["impl"] == "ours"]
    assert ours and ours[0]["status"] == "ok" and ours[0]["fwd"] and ours[0]["bwd"], ours


@pytest.mark.parametrize("script", [BENCH, PROFILE], ids=["benchmark", "profile"])
def test_help_documents_the_options(script):
    p = _run([script, "--help"], timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--device", "--out", "--peers"):
        assert opt in p.stdout


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("script", [BENCH, PROFILE], ids=["benchmark", "profile"])
def test_without_gpu_one_clear_line_and_exit_2(script, tmp_path):
    p = _run([script, "--out", str(tmp_path)], timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CUDA GPU" in lines[0] and "flash-qla[sm90]" in lines[0], lines
    assert "Traceback" not in p.stderr


def test_grids_match_the_issue():
    assert len(C.forward_grid()) == 11 * 9
    assert len(C.backward_grid()) == 7 * 8
    assert {s.tokens for s in C.backward_grid()} == {8192, 32768}
    assert len(C.QUICK) == 5
    for name, (seed, n) in C.VARLEN_MIXES.items():
        lens = C.varlen_mix(seed, n)
        assert len(lens) == n and sum(lens) == 32768 and min(lens) >= 1
        assert lens == C.parse_layout(name)  # deterministic


def test_select_shapes_filters_and_adds_custom():
    grid = C.forward_grid() + C.backward_grid()
    got = C.select_shapes("16/32@1x8192", ["fwd", "bwd"], grid)
    assert [s.key for s in got] == ["fwd:16/32@1x8192", "bwd:16/32@1x8192"]
    assert len(C.select_shapes("fwd:*@varlen-*", ["fwd", "bwd"], grid)) == 22
    assert [s.key for s in C.select_shapes("3/6@seqs=5+7", ["fwd"], grid)] == ["fwd:3/6@seqs=5+7"]
    with pytest.raises(ValueError):
        C.select_shapes("3/5@1x64", ["fwd"], grid)  # Hv not a multiple of Hk
    with pytest.raises(ValueError):
        C.select_shapes("99/99@*", ["fwd"], grid)  # wildcard matching nothing


def test_floor_matches_gdn_math_example():
    # gdn-math.md / anchors.md: B=1, T=32768, Hv=16 moves ~0.6 GB, ~0.09 TFLOP, floor ~0.14 ms
    f = C.shape_floor(C.Shape.from_key("fwd:16/16@1x32768"))
    assert 0.55e9 < f["bytes"] < 0.65e9 and 0.085e12 < f["flops"] < 0.095e12
    assert 0.13 < f["floor_ms"] < 0.15 and f["bound"] == "memory"


def test_static_unsupported_rules():
    hopper = {"device": "cuda", "capability": [9, 0], "fla_version": "0.5.0"}
    gva_bwd, mha_bwd = C.Shape.from_key("bwd:16/32@1x8192"), C.Shape.from_key("bwd:16/16@1x8192")
    assert C.static_unsupported("fla", gva_bwd, hopper).startswith("unsupported")
    assert C.static_unsupported("fla", gva_bwd, {**hopper, "fla_version": "0.6.0"}) is None
    assert C.static_unsupported("fla", mha_bwd, hopper) is None
    assert C.static_unsupported("flashinfer", mha_bwd, hopper).startswith("unsupported")
    assert C.static_unsupported("fla", mha_bwd, {"device": "cpu"}).startswith("skipped")
    assert C.gpu_tag("NVIDIA H200") == "H200"


def test_tune_help():
    p = _run([TUNE, "--help"], timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--shapes", "--compile-only", "--cache-dir"):
        assert opt in p.stdout


def test_tune_fits_the_forward_cost_model():
    """The per-kernel median of "us/unit" over uniform-length shapes (varlen rows left
    out) is what ``flash_qla_tl.plan``'s FWD_CHUNK_US and PREPARE_US_PER_CHUNK_HEAD
    hold."""
    sys.path.insert(0, os.path.dirname(TUNE))
    import tune_chunk_fwd

    rows = [["2/8 1x32768", "prepare", "1.1e-03", 0.07, 0.0167],
            ["16/16 4x8192", "prepare", "1.1e-03", 0.13, 0.0153],
            ["16/64 1x32768", "prepare", "1.1e-03", 0.5, 0.0159],
            ["2/8 1x32768", "ws", "3.2e-03", 1.97, 3.85],
            ["16/16 4x8192", "ws", "3.4e-03", 0.5, 3.72],
            ["16/32 varlen-a (8 seqs)", "ws", "3.4e-03", 1.6, 25.0]]
    assert tune_chunk_fwd.fit_costs(rows) == {"FWD_CHUNK_US": 3.79,
                                              "PREPARE_US_PER_CHUNK_HEAD": 0.0159}


@needs_ours
@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA GPU")
def test_tune_without_gpu_one_clear_line_and_exit_2():
    p = _run([TUNE, "--shapes", "2/4@1x64"], timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CUDA GPU" in lines[0] and "flash-qla[sm90]" in lines[0], lines


def test_benchmark_install_hint_matches_the_core():
    from flash_qla import dispatch

    assert C.INSTALL_HINT == dispatch.install_hint((9, 0))


def test_fla_tuning_option():
    """--fla-tuning: per-shape keeps FLA from reusing tunings (FLA_CACHE_RESULTS=0), cached
    is FLA's own default; the benchmark documents the option."""
    assert (C.fla_cache_results("per-shape"), C.fla_cache_results("cached")) == ("0", "1")
    with pytest.raises(ValueError, match="per-shape"):
        C.fla_cache_results("shared")
    p = _run([BENCH, "--help"], timeout=60)
    assert p.returncode == 0, p.stderr
    assert "--fla-tuning" in p.stdout and "cached" in p.stdout


@needs_ours
def test_benchmark_worker_per_heads_batches_a_group(tmp_path):
    """--worker-per heads: the two forward configs of 2/4 share one worker process (one
    log), each still gets its own row; only the group's first keeps a first-call time."""
    import bench_gated_delta_rule as bench  # benchmark/ is on sys.path

    shapes = "fwd:2/4@1x128,fwd:2/4@seqs=50+78,bwd:2/2@1x64"
    assert [len(g) for g in
            bench._worker_groups(C.select_shapes(shapes, ["fwd", "bwd"], []), "heads")
            ] == [2, 1]
    assert [len(g) for g in bench._worker_groups(            # --worker-per mode
        C.select_shapes("fwd:2/4@1x128,fwd:4/8@1x128,bwd:2/2@1x64", ["fwd", "bwd"], []),
        "mode")] == [2, 1]
    p = _run([BENCH, "--device", "cpu", "--out", str(tmp_path), "--worker-per", "heads",
              "--shapes", shapes, "--keep-scratch"])
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "cpu.json").read_text())
    ours = {r["shape"]: r for r in data["results"] if r["impl"] == "ours"}
    assert len(ours) == 3 and all(r["status"] == "ok" and r["eager_ms"] > 0
                                  for r in ours.values()), ours
    assert sum(r.get("first_call_s") is not None for r in ours.values()) == 2
    scratch = p.stderr.split("scratch kept in ")[1].split()[0]
    logs = sorted(f for f in os.listdir(scratch) if f.endswith(".log") and "-ours" in f)
    assert len(logs) == 2 and any(f.endswith("-x2.log") for f in logs), logs
    assert data["meta"]["worker_per"] == "heads"


def test_min_seq_heads_selects_the_issue_grids():
    """--min-seq-heads 64 --list: issue 4's 57 forward rows, issue 5's six Hk = Hv rows."""
    p = _run([BENCH, "--mode", "fwd", "--min-seq-heads", "64", "--list"], timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [line.split()[0] for line in p.stdout.splitlines()]
    assert len(rows) == 57 and "fwd:16/64@1x32768" in rows and "fwd:16/16@1x32768" not in rows
    p = _run([BENCH, "--mode", "fwd", "--max-seq-heads", "64", "--list"], timeout=60)
    few = [line.split()[0] for line in p.stdout.splitlines()]
    assert len(few) == 42 and not set(few) & set(rows) and "fwd:16/16@1x32768" in few
    p = _run([BENCH, "--min-seq-heads", "64", "--max-seq-heads", "64", "--list"], timeout=60)
    assert p.returncode == 1 and "no configuration selected" in p.stderr, p.stderr
    p = _run([BENCH, "--mode", "bwd", "--min-seq-heads", "64", "--shapes",
              "16/16@*,8/8@*,4/4@*", "--list"], timeout=60)
    assert [line.split()[0] for line in p.stdout.splitlines()] == [f"bwd:{s}" for s in (
        "16/16@4x2048", "16/16@8x1024", "16/16@4x8192", "16/16@8x4096", "8/8@8x1024",
        "8/8@8x4096")]


def test_sass_report_charges_inlined_instructions_to_their_call_site():
    """tools/sass_report.py: an instruction inlined from a header counts at the line of
    the kernel's source that called it; one outside the kernel's lines at line 0."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import sass_report

    sass = "\n".join([
        '\t//## File "/tmp/x/kernel.cu", line 12',
        "        /*0010*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;",
        '\t//## File "/inc/mma.hpp", line 53 inlined at "/tmp/x/kernel.cu", line 40',
        "        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;",
        "        /*0030*/              @!P0 BRA `(.L_x_1) ;",
        '\t//## File "/inc/common.h", line 9',
        "        /*0040*/                   R2UR UR4, R2 ;",
    ])
    ops, per_line = sass_report.parse(sass, "kernel.cu")
    assert ops == {"IMAD": 1, "HGMMA": 1, "BRA": 1, "R2UR": 1}
    assert {n: dict(c) for n, c in per_line.items()} == {
        12: {"IMAD": 1}, 40: {"HGMMA": 1, "BRA": 1}, 0: {"R2UR": 1}}



def test_ncu_roles_splits_stall_samples_at_setmaxnreg(tmp_path):
    """tools/ncu_roles.py: instructions belong to the role whose USETMAXREG precedes
    them (DEALLOC: aux, else state); each row's top stall reasons are listed; the .xz
    of v14 call 2's dh sweep reads too (~45% of its state samples on PRMT / STG / F2FP)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import ncu_roles

    head = ["Address", "Source", ncu_roles.SAMPLES, ncu_roles.EXECUTED, "stall_long_sb",
            "stall_wait", "stall_long_sb (Not Issued)"]
    body = [["0", "LDC R1, c[0x0][0x28]", "2", "10", "0", "2", "0"],
            ["1", "USETMAXREG.DEALLOC.CTAPOOL 0x58", "0", "10", "0", "0", "0"],
            ["2", "FMUL R2, R2, R3", "5", "40", "1", "4", "1"],
            ["3", "USETMAXREG.TRYALLOC.CTAPOOL 0xd0", "0", "20", "0", "0", "0"],
            ["4", "@!P1 BRA 0x10", "7", "80", "7", "0", "7"]]
    path = tmp_path / "ncu-sass.csv"
    path.write_text("\n".join(",".join(f'"{c}"' for c in row)
                              for row in [["Kernel Name", "k"], head, *body]))
    per_role, per_insn = ncu_roles.split_by_role(*ncu_roles.read_rows(str(path)))
    assert per_role == {"prologue": [2, 10], "aux@1": [5, 50], "state@3": [7, 100]}
    assert per_insn[4][2:] == ("state@3", "@!P1 BRA 0x10", "long_sb 7")
    dh = os.path.join(REPO, "benchmark", "results", "H200-v14-2026-12-01", "call2", "ncu-dh",
                      "ncu-sass.csv.xz")
    per_role, per_insn = ncu_roles.split_by_role(*ncu_roles.read_rows(dh))
    state = [x for x in per_insn if x[2].startswith("state")]
    store = sum(n for n, _, _, src, _ in state
                if src.split()[0].split(".")[0] in ("PRMT", "STG", "F2FP"))
    assert 0.4 < store / sum(n for n, *_ in state) < 0.5

def test_segment_len_option():
    assert C.segment_len_arg("4096") == 4096
    assert C.segment_len_arg("off") == "off"
    with pytest.raises(argparse.ArgumentTypeError, match="'off'"):
        C.segment_len_arg("auto")


def test_segment_cost_fit_reproduces_the_traits():
    """fit_segment_cost.py on the committed H200 rows the traits were fitted from gives
    the traits' exact-split constants back, and a host floor for the bounded split."""
    pytest.importorskip("flash_qla_tl", reason="flash-qla-tilelang is not installed")
    res = os.path.join(REPO, "benchmark", "results")
    exact = [os.path.join(res, "H200-v5-2026-11-30", "call3", f"H200-seg-{n}.json")
             for n in (1024, 2048, 4096)]
    bounded = [os.path.join(res, "H200-v6-2026-11-30", "call4", "H200-fla.json")]
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmark", "fit_segment_cost.py"),
         "--exact", *exact, "--bounded", *bounded],
        capture_output=True, text=True, timeout=120, check=True).stdout
    assert "SEGMENT_SCAN_STEP_US = 45.1, SEGMENT_FIXED_US = 730" in out
    floor = int(out.split("WARMUP_HOST_US = ")[1].split()[0])
    assert 400 < floor < 700


def test_segment_cost_fit_doctest():
    import doctest

    sys.path.insert(0, os.path.join(REPO, "benchmark"))
    import fit_segment_cost

    assert doctest.testmod(fit_segment_cost).failed == 0


def test_flashqla_peer_precompile_help():
    """tools/prepare_flashqla_peer.py (the peer's kernels compiled ahead of time) parses
    its options without the peer or a GPU."""
    p = _run([os.path.join(REPO, "tools", "prepare_flashqla_peer.py"), "--help"], timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--flashqla-path", "--cache-dir", "--heads", "--modes", "--list"):
        assert opt in p.stdout


def test_backward_table_shows_the_training_step_eager_and_graphed():
    """``bench --mode bwd``'s table: the fwd+bwd cells are ``eager / graph`` (the graph
    the captured training step's replay), the peer's speedup likewise, the training step
    back to back with its own speedup, and a step that could not be captured is named in
    the notes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gdr", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    key = "bwd:16/16@8x4096"
    ours = {"status": "ok", "eager_ms": 1.0, "fwdbwd_eager_ms": 2.0, "fwdbwd_graph_ms": 1.5,
            "fwdbwd_b2b_ms": 1.8, "fwdbwd_graph_status": "ok"}
    fla = {"status": "ok", "eager_ms": 2.0, "fwdbwd_eager_ms": 4.0, "fwdbwd_graph_ms": 4.5,
           "fwdbwd_b2b_ms": 4.5, "fwdbwd_graph_status": "ok", "err": {"o": 1e-3}}
    headers, rows = bench.table_rows({(key, "ours"): ours, (key, "fla"): fla}, "bwd",
                                     ["fla"], tol=1e-2)
    row = dict(zip(headers, rows[0]))
    assert row["ours fwd+bwd ms eager / graph"] == "2.000 / 1.500"
    assert row["FLA fwd+bwd ms"] == "4.000 / 4.500"
    assert row["vs FLA fwd+bwd"] == "2.00x / 3.00x"
    assert row["ours fwd+bwd ms back-to-back"] == "1.800"
    assert row["vs FLA fwd+bwd back-to-back"] == "2.50x"
    headers, rows = bench.table_rows({("fwd:2/8@1x8192", "ours"): {**ours, "b2b_ms": 0.4},
                                      ("fwd:2/8@1x8192", "fla"): {**fla, "b2b_ms": 0.5}},
                                     "fwd", ["fla"], tol=1e-2, floor=False)
    row = dict(zip(headers, rows[0]))
    assert row["ours ms back-to-back"] == "0.400" and row["vs FLA back-to-back"] == "1.25x"
    fla["fwdbwd_graph_status"] = "not capturable: RuntimeError: sync"
    assert any("fwd+bwd graph column: not capturable" in n
               for n in bench.notes({(key, "ours"): ours, (key, "fla"): fla}))


@needs_ours
def test_unsplit_peer_is_ours_without_the_split(tmp_path):
    """--peers unsplit runs ours with auto_cp=False beside the default, on the CPU too
    (our torch backend): its rows are ok, match ours and get a 'vs unsplit' column."""
    shapes = "fwd:2/4@1x128,bwd:2/2@1x64"
    p = _run([BENCH, "--device", "cpu", "--out", str(tmp_path), "--peers", "unsplit",
              "--worker-per", "heads", "--shapes", shapes])
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "cpu.json").read_text())
    rows = {(r["impl"], r["shape"]): r for r in data["results"]}
    for key in ("fwd:2/4@1x128", "bwd:2/2@1x64"):
        unsplit = rows[("unsplit", key)]
        assert unsplit["status"] == "ok" and unsplit["eager_ms"] > 0, unsplit
        assert unsplit["err_max"] < 1e-6, unsplit      # the tiny shapes are never split
    assert "vs unsplit" in (tmp_path / "cpu.md").read_text()
    assert C.static_unsupported("unsplit", C.Shape.from_key("bwd:2/2@1x64"),
                                {"device": "cpu"}) is None


def _summary(md: str) -> list[dict]:
    """The rows of a profile report's summary table, as {header: cell} dicts."""
    table = md.split("## Summary")[1].split("\n## ")[0]
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    split = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]  # noqa: E731
    return [dict(zip(split(lines[0]), split(ln))) for ln in lines[2:]]


def test_profile_peers_option_and_summary_columns(tmp_path, capsys):
    """profile_gdr --peers: a comma-separated list of the benchmark's peers (an unknown one
    is one clear error, exit 1, before any worker); the summary gets two columns per peer
    and direction (FLA's as before), each implementation its own per-kernel listing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_gdr", PROFILE)
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    assert C.parse_peers("fla, flashqla,fla") == ["fla", "flashqla"]
    assert C.parse_peers("none") == [] and C.parse_peers("") == []
    assert prof.main(["--peers", "fla,flashqlaa", "--out", str(tmp_path)]) == 1
    assert "unknown peer(s) ['flashqlaa']" in capsys.readouterr().err
    assert "--flashqla-path" in prof.build_parser().format_help()

    key = "fwd:4/16@1x32768"
    ks = lambda *us: {f"k{i}": {"us": u, "calls": 1.0} for i, u in enumerate(us)}  # noqa: E731
    results = [
        {"impl": "ours", "shape": key, "status": "ok", "fwd": ks(100.0, 50.0), "bwd": ks(300.0)},
        {"impl": "fla", "shape": key, "status": "ok", "fwd": ks(300.0),
         "bwd_status": "unsupported: no GVA backward"},
        {"impl": "flashqla", "shape": key, "status": "ok", "fwd": ks(120.0, 30.0),
         "bwd": ks(450.0)},
    ]
    meta = {"device_name": "NVIDIA H200", "command": "profile_gdr.py", "date": "today",
            "versions": {"ours": "0.2", "flashqla": "0.1.3"}}
    for peers, out in (("fla", tmp_path / "fla"), ("fla,flashqla", tmp_path / "both")):
        args = prof.build_parser().parse_args(["--out", str(out), "--peers", peers])
        args.iters = 10
        keep = ["ours"] + C.parse_peers(peers)
        prof.render(meta, [r for r in results if r["impl"] in keep], args, "H200")
    (fla,) = _summary((tmp_path / "fla" / "develop-H200.md").read_text())
    assert list(fla) == ["config", "tokens", "ours fwd us", "FLA fwd us", "vs FLA fwd",
                         "floor us", "ours % of floor", "ours bwd us", "FLA bwd us",
                         "vs FLA bwd"]       # the default's columns, as before
    md = (tmp_path / "both" / "develop-H200.md").read_text()
    (row,) = _summary(md)
    assert (row["FLA fwd us"], row["vs FLA fwd"]) == ("300.0", "2.00x")
    assert (row["FlashQLA-0.1.3 fwd us"], row["vs FlashQLA-0.1.3 fwd"]) == ("150.0", "1.00x")
    assert (row["FLA bwd us"], row["vs FLA bwd"]) == ("unsupported: no GVA backward", "")
    assert (row["FlashQLA-0.1.3 bwd us"], row["vs FlashQLA-0.1.3 bwd"]) == ("450.0", "1.50x")
    assert "**FlashQLA (peer) fwd**: 150.0 us per call, 2 kernels" in md
    assert "FLA bwd: unsupported: no GVA backward" in md


@needs_ours
def test_profile_cpu_with_several_peers(tmp_path):
    """--device cpu --peers unsplit,flashqla: unsplit (ours, auto_cp=False) is profiled on
    the CPU beside ours, FlashQLA 0.1.3 is skipped there; both get summary columns."""
    p = _run([PROFILE, "--device", "cpu", "--out", str(tmp_path), "--peers",
              "unsplit,flashqla", "--skip-bwd"])
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "cpu-torch.json").read_text())
    status = {r["impl"]: r["status"] for r in data["results"]}
    assert status == {"ours": "ok", "unsplit": "ok", "flashqla": "skipped"}, status
    (row,) = _summary((tmp_path / "cpu-torch.md").read_text())
    assert row["vs unsplit fwd"].endswith("x") and row["FlashQLA-0.1.3 fwd us"] == "skipped"


def test_scratch_names_of_long_layouts_stay_short_and_distinct():
    """A seqs=... layout of many sequences makes a key longer than a file name may be:
    its scratch name is cut and made unique by a hash of the whole key."""
    import bench_gated_delta_rule as bench  # benchmark/ is on sys.path

    lens = "+".join(str(200 + i) for i in range(64))
    a, b = bench._safe(f"fwd:2/4@seqs={lens}"), bench._safe(f"fwd:2/4@seqs={lens}+1")
    assert len(a) <= 120 and len(b) <= 120 and a != b
    assert bench._safe("fwd:2/4@1x8192") == "fwd-2_4-1x8192"


def test_flashinfer_versions_get_their_call_options():
    """FlashInfer 0.6.x and 0.7.x share the call the benchmark makes; 0.7.x (CuTe-DSL
    kernels) also gets backend="auto" and use_cp, which 0.6.x does not know."""
    assert C.flashinfer_gdn_generation("0.6.13") == "cpp-module"
    assert C.flashinfer_gdn_generation("0.7.4") == "cute-dsl"
    assert C.flashinfer_gdn_generation("0.7.4.post1") == "cute-dsl"
    assert C.flashinfer_gdn_generation("1.0.0rc1") == "cute-dsl"
    assert C.flashinfer_gdn_generation("?") == "cpp-module"
    assert C.flashinfer_call_options("0.6.13") == {}
    assert C.flashinfer_call_options("0.7.4") == {"backend": "auto", "use_cp": "auto"}
    assert C.flashinfer_call_options("0.7.4", "on")["use_cp"] is True
    assert C.flashinfer_call_options("0.7.4", "off")["use_cp"] is False
    with pytest.raises(ValueError, match="no use_cp"):
        C.flashinfer_call_options("0.6.13", "off")
    with pytest.raises(ValueError):
        C.flashinfer_call_options("0.7.4", "yes")


def test_flashinfer_prebuilt_module_gate_is_for_0_6_only():
    """0.6.x without a prebuilt GDN module is skipped unless --flashinfer-jit (its nvcc JIT
    takes > 7.5 min); 0.7.x compiles CuTe-DSL kernels in-process: never skipped for that."""
    for version, built, jit, skipped in (("0.6.13", False, False, True),
                                         ("0.6.13", True, False, False),
                                         ("0.6.13", False, True, False),
                                         ("0.7.4", False, False, False)):
        info = {"versions": {"ours": "0.2.0", "flashinfer": version},
                "flashinfer_gdn_built": built}
        why = C.peer_availability(["flashinfer"], info, "cuda", None, jit)["flashinfer"]
        assert (why is not None and why.startswith("skipped")) == skipped, (version, built, jit)


@pytest.mark.parametrize("version", ["0.6.13", "0.7.4"])
def test_flashinfer_adapter_maps_arguments_by_version(version, monkeypatch):
    """The FlashInfer adapter against a stand-in module: 0.6.x gets the 0.6 keywords only;
    0.7.x also backend, use_cp (--flashinfer-cp) and max_seqlen = the longest sequence;
    states go in as [N,H,V,K] and come back to [N,H,K,V]; g goes in as alpha = exp(g)."""
    import types

    import torch

    seen = {}

    def fake(q, k, v, g=None, beta=None, scale=None, initial_state=None,
             output_final_state=False, cu_seqlens=None, **kw):
        seen.update(q=q, g=g, beta=beta, h0=initial_state, cu=cu_seqlens, kw=kw)
        n, h = initial_state.shape[:2]
        return torch.zeros(q.shape[0], h, v.shape[-1]), initial_state.clone()

    fi = types.ModuleType("flashinfer")
    fi.__version__ = version
    gdn = types.ModuleType("flashinfer.gdn_prefill")
    gdn.chunk_gated_delta_rule = fake
    gdn.chunk_gated_delta_rule_sm90 = fake
    fi.gdn_prefill = gdn
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", gdn)

    shape = C.Shape.from_key("fwd:2/4@seqs=50+78")
    inp = C.make_inputs(shape, "model", 0, "cpu", with_grads=False)
    impl = C.FlashInfer()
    ctx = {"capability": [9, 0], "flashinfer_cp": "off" if version == "0.7.4" else "auto"}
    assert impl.load(ctx) == version
    a = impl.prepare(inp, ctx)
    o, ht = impl.canon(impl.call(a), a)
    if version == "0.7.4":
        assert seen["kw"] == {"backend": "auto", "use_cp": False, "max_seqlen": 78}
    else:
        assert seen["kw"] == {}
    assert seen["cu"].dtype == torch.int64 and seen["cu"].tolist() == [0, 50, 128]
    assert seen["q"].shape == (128, 2, 128)
    assert seen["g"].dtype == torch.float32
    torch.testing.assert_close(seen["g"], inp["g"].reshape(128, 4).exp())
    torch.testing.assert_close(seen["h0"], inp["h0"].transpose(-1, -2))
    torch.testing.assert_close(ht, inp["h0"])
    assert o.shape == (1, 128, 4, 128)
    # 0.6.x has no use_cp: asking for one reports FlashInfer as not installed
    if version == "0.6.13":
        with pytest.raises(ImportError, match="no use_cp"):
            C.FlashInfer().load({"flashinfer_cp": "on"})
    # 0.7.x whose SM90 kernel did not import (e.g. no nvidia-cutlass-dsl) on an SM90 GPU
    if version == "0.7.4":
        gdn.chunk_gated_delta_rule_sm90 = None
        with pytest.raises(ImportError, match="CuTe-DSL"):
            C.FlashInfer().load({"capability": [9, 0]})
        assert C.FlashInfer().load({"capability": [10, 0]}) == version


@needs_ours
def test_resume_keeps_ours_row_when_ours_only_makes_the_reference(tmp_path):
    """A peer measured in a later call (--resume) reruns ours only for the reference
    outputs: ours' row from the first call stays (timings and all), so the later call may
    use another backend for the reference (the FlashInfer-only device call does), and the
    peers of the first call keep their versions in the report's metadata."""
    shape = "fwd:2/4@1x128"
    first = _run([BENCH, "--device", "cpu", "--out", str(tmp_path), "--peers", "none",
                  "--shapes", shape])
    assert first.returncode == 0, first.stdout + first.stderr
    before = json.loads((tmp_path / "cpu.json").read_text())
    ours_before = next(r for r in before["results"] if r["impl"] == "ours")
    before["meta"]["versions"]["fla"] = "9.9.9"    # as if an earlier call had measured FLA
    (tmp_path / "cpu.json").write_text(json.dumps(before))
    second = _run([BENCH, "--device", "cpu", "--out", str(tmp_path), "--peers", "unsplit",
                   "--shapes", shape, "--resume"])
    assert second.returncode == 0, second.stdout + second.stderr
    after = json.loads((tmp_path / "cpu.json").read_text())
    rows = {r["impl"]: r for r in after["results"]}
    assert rows["unsplit"]["status"] == "ok" and rows["unsplit"]["err_max"] < 1e-6
    assert rows["ours"]["eager_ms"] == ours_before["eager_ms"]
    assert rows["ours"]["reference_rerun"]["status"] == "ok"   # its backend: torch on cpu
    assert after["meta"]["versions"]["fla"] == "9.9.9"


def test_serving_grid_is_the_issue_s():
    """256 to 16k packed tokens of many short sequences (4x64 ... 32x512 and two ragged
    mixes) at 16/32 and 16/64, forward only."""
    grid = C.serve_grid()
    assert {(s.hk, s.hv) for s in grid} == {(16, 32), (16, 64)}
    assert {s.mode for s in grid} == {"fwd"}
    assert sorted({s.tokens for s in grid}) == [256, 1024, 2048, 4096, 16384]
    for name, (_, n, total) in C.SERVE_MIXES.items():
        lens = C.parse_layout(name)
        assert len(lens) == n and sum(lens) == total and min(lens) >= 1
    env = {"device": "cuda", "serve": True}
    assert C.static_unsupported("flashqla", grid[0], env).startswith("unsupported")
    assert C.static_unsupported("flashinfer", grid[0], env) is None


def _fake_fla(**kw):
    """FLA's chunk_gated_delta_rule keywords, run by our torch backend."""
    import flash_qla

    kw.pop("cu_seqlens_cpu")
    return flash_qla.chunk_gated_delta_rule(**kw, backend="torch")


def _fake_flashinfer(q, k, v, *, g, beta, scale, output_final_state, cu_seqlens,
                     initial_state, output_state=None, state_indices=None):
    """FlashInfer 0.7's gdn_prefill contract (packed [T, H, D], alpha = exp(g), v-first
    states; with state_indices the pool is read and ``output_state`` written at the
    indices), run by our torch backend."""
    import flash_qla

    args = dict(q=q[None], k=k[None], v=v[None], g=g.log()[None], beta=beta[None],
                cu_seqlens=cu_seqlens, output_final_state=True, state_v_first=True,
                backend="torch")
    if state_indices is None:
        o, ht = flash_qla.chunk_gated_delta_rule(**args, initial_state=initial_state)
        return o[0], ht
    assert output_state is initial_state          # in place, as the adapter calls it
    o, pool = flash_qla.chunk_gated_delta_rule(**args, initial_state=initial_state,
                                               state_indices=state_indices)
    return o[0], pool


@needs_ours
@pytest.mark.parametrize("pool_dtype", C.SERVE_POOL_DTYPES)
def test_serving_adapters_agree_on_the_pool(pool_dtype):
    """The serving grid's three adapters (ours on the pool, FLA's gather / call /
    scatter, FlashInfer's state_indices and its 0.6 fallback), each driven on the same
    pool by a stand-in of the peer built on our torch backend: same o, same rows
    written, other rows untouched."""
    import torch

    shape = C.Shape.from_key("fwd:2/4@seqs=50+78+1")
    inp = C.make_inputs(shape, "model", 0, "cpu", with_grads=False)
    ctx = {"serve_pool_dtype": pool_dtype, "ours_backend": "torch"}
    ours = C.OursServe()
    ours.load(ctx)
    a = ours.prepare(inp, ctx)
    before = a["pool"].clone()
    o_ref, ht_ref = ours.canon(ours.call(a), a)
    unnamed = sorted(set(range(before.shape[0])) - set(a["slots"].tolist()))
    assert torch.equal(a["pool"][unnamed], before[unnamed])
    assert C.rel_err(ht_ref, C._pool_rows(before, a["slots"], True)) > 0.01   # written
    fla = C.FLAServe()
    fla.fn = _fake_fla
    fi_indices, fi_gather = C.FlashInferServe(), C.FlashInferServe()
    for peer, indices in ((fi_indices, True), (fi_gather, False)):
        peer.fn, peer.options, peer.pass_max_seqlen = _fake_flashinfer, {}, False
        peer.has_indices = indices
    for peer in (fla, fi_indices, fi_gather):
        b = peer.prepare(inp, ctx)
        o, ht = peer.canon(peer.call(b), b)
        # (FlashInfer's stand-in takes log(exp(g)) and fp32 beta: bf16 o differs in ulps)
        assert C.rel_err(o, o_ref) < 1e-3 and C.rel_err(ht, ht_ref) < 1e-3, type(peer)


@needs_ours
def test_benchmark_serve_grid_on_cpu(tmp_path):
    """--grid serve --device cpu: ours on its pool (torch backend) writes the -serve
    files, the table says how the pool was used, the peers are only FLA and FlashInfer."""
    p = _run([BENCH, "--grid", "serve", "--device", "cpu", "--no-graphs",
              "--out", str(tmp_path)])
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "cpu-serve.json").read_text())
    ours = [r for r in data["results"] if r["impl"] == "ours"]
    assert [r["shape"] for r in ours] == C.CPU_SERVE
    assert all(r["status"] == "ok" and r["eager_ms"] > 0 for r in ours), ours
    assert {r["impl"] for r in data["results"]} == {"ours", "fla", "flashinfer"}
    assert "serving grid" in (tmp_path / "cpu-serve.md").read_text()


@needs_ours
def test_host_proxy_counts_one_calls_launches_and_ops():
    """tools/host_proxy.py (the sm90 host path on meta tensors, launches counted): a
    dense training step takes the split's kernels once each (prepare, forward, the dh
    boundary sweep, the fused backward, two GVA sums), a varlen inference forward the
    prepare and the forward; both report a host time and their aten ops."""
    pytest.importorskip("tilelang", reason="TileLang is not installed")
    pytest.importorskip("flash_qla_sm90", reason="flash-qla-sm90 is not installed")
    tool = os.path.join(REPO, "tools", "host_proxy.py")
    p = _run([tool, "--shapes", "8/16@4x4096", "--dense-batch", "--iters", "3"], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    row = next(line for line in p.stdout.splitlines() if "8/16 4x4096 dense" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "step" and float(cells[2]) > 0 and cells[3] == "6", cells
    assert cells[4] == ("chunk_bwd_dh_ws_kernel 1, chunk_bwd_fused_kernel 1, "
                        "chunk_fwd_ws_kernel 1, chunk_prepare_kernel 1, "
                        "group_sum_kernel 2"), cells
    assert int(cells[5]) > 0, cells
    p = _run([tool, "--shapes", "2/4@seqs=100+37+300", "--mode", "inference", "--iters", "3"],
             timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    row = next(line for line in p.stdout.splitlines() if "2/4 seqs=100+37+300" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:2] == ["inference"] and cells[4] == (
        "chunk_fwd_ws_kernel 1, chunk_prepare_kernel 1"), cells
