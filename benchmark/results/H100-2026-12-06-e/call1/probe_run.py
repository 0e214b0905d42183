"""Lever-1 probe: chunk_fwd_ws chain orders / budgets, and the prepare's latency per CTA.

python probe_l1/run.py --compile   (CPU: builds the variants into TILELANG_CACHE_DIR)
python probe_l1/run.py             (GPU: checks and times)
"""
import dataclasses, importlib.util, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmark"))
from flash_qla_sm90.arch import SM90

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = [("base", "cso_base.py", (208, 88)), ("A208", "cso_A.py", (208, 88)),
            ("A192", "cso_A.py", (192, 120)), ("B208", "cso_B.py", (208, 88)),
            ("B192", "cso_B.py", (192, 120)), ("inv", "", None), ("base2", "cso_base.py", (208, 88))]
if os.environ.get("VARIANTS"):
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["VARIANTS"].split(",")]


def build(name, file, budget):
    if name == "inv":
        from flash_qla_tl.kernels.chunk_state_output import chunk_fwd_ws_kernel
        return SM90, chunk_fwd_ws_kernel(SM90, "bfloat16", 128, 128, False, False, False,
                                         False, False, None, False, True)
    spec = importlib.util.spec_from_file_location(f"probe_{name}", os.path.join(HERE, file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rb = tuple((k, budget) if k == "chunk_fwd_ws" else (k, v) for k, v in SM90.reg_budgets)
    arch = dataclasses.replace(SM90, reg_budgets=rb)
    return arch, mod.chunk_fwd_ws_kernel(arch, "bfloat16", 128, 128, False, False)


def build_only(*v):
    build(*v)


def main():
    if "--compile" in sys.argv:
        import concurrent.futures as cf
        with cf.ProcessPoolExecutor(int(os.environ.get("JOBS", "2"))) as ex:
            futs = {ex.submit(build_only, *v): v[0] for v in VARIANTS}
            for f in cf.as_completed(futs):
                f.result(); print("compiled", futs[f], flush=True)
        return
    import torch
    from common import Shape, make_inputs, rel_err, time_fns
    import flash_qla
    from flash_qla_tl.kernels.chunk_cumsum_inverse import chunk_prepare_blocked_kernel
    from flash_qla_tl.layout import layout_for, packed
    kernels = {name: build(name, f, b) for name, f, b in VARIANTS}
    rows = []
    for spec in os.environ.get("SHAPES", "16/32@seqs=5000+3000+2500+2000+2384+1500,16/16@1x32768,16/32@8x4096").split(","):
        shape = Shape.from_key(f"fwd:{spec}")
        inp = make_inputs(shape, "model", 0, "cuda", with_grads=False)
        q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
        cu = inp["cu_seqlens_cpu"].to("cuda", torch.int32)
        Tt, Hv = q.shape[1], v.shape[2]
        layout = layout_for(q, cu, SM90)
        scale = 128 ** -0.5
        _, _, ref_o, _, ref_s = flash_qla.chunk_gated_delta_rule_fwd(
            q.float(), k.float(), v.float(), g, beta.float(), scale=scale, initial_state=None,
            output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=inp["cu_seqlens_cpu"],
            backend="torch")
        k_p, beta_p, g_p, q_p, v_p = packed(k), packed(beta, torch.float32), packed(g, torch.float32), packed(q), packed(v)
        g_cumsum = torch.zeros(Tt, Hv, dtype=torch.float32, device="cuda")
        A = torch.zeros(Tt, Hv, 64, dtype=q.dtype, device="cuda")
        prep = chunk_prepare_blocked_kernel(SM90, "bfloat16", 128)
        prep(k_p, g_p, beta_p, layout.cu_seqlens, layout.chunk_idx, g_cumsum, A)
        torch.cuda.synchronize()
        ms_prep = time_fns([lambda: prep(k_p, g_p, beta_p, layout.cu_seqlens, layout.chunk_idx, g_cumsum, A)], "cuda", warmup_ms=25, rep_ms=100)
        rows.append((spec, "prepare", "", round(ms_prep, 4)))
        h0 = torch.empty(1, device="cuda")
        for name, (arch, kern) in kernels.items():
            o = torch.empty(Tt, Hv, 128, dtype=q.dtype, device="cuda")
            fs = torch.empty(layout.num_seqs, Hv, 128, 128, dtype=torch.float32, device="cuda")
            hh = torch.empty(1, Hv, 128, 128, device="cuda")
            z = torch.zeros(1, dtype=torch.int32, device="cuda")
            args = (q_p, k_p, v_p, g_cumsum, beta_p, A, layout.cu_seqlens, layout.chunk_offsets,
                    fs, float(scale), o, fs, hh, z, z, 0.0)
            if name == "inv":
                args = (q_p, k_p, v_p, g_p, beta_p, A[:1], layout.cu_seqlens, layout.chunk_offsets,
                        fs, float(scale), o, fs, hh, z, z, 0.0)
            kern(*args); torch.cuda.synchronize()
            err = max(rel_err(o.view_as(ref_o), ref_o), rel_err(fs, ref_s))
            ms = time_fns([lambda: kern(*args)], "cuda", warmup_ms=25, rep_ms=100)
            rows.append((spec, name, f"{err:.1e}", round(ms, 4)))
            print(rows[-1], flush=True)
    # the prepare's latency: m CTAs (chunks x heads) on 132 SMs
    shape = Shape.from_key("fwd:16/32@8x4096")
    inp = make_inputs(shape, "model", 0, "cuda", with_grads=False)
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    cu = inp["cu_seqlens_cpu"].to("cuda", torch.int32)
    layout = layout_for(q, cu, SM90)
    k_p, beta_p, g_p = packed(k), packed(beta, torch.float32), packed(g, torch.float32)
    Tt, Hv = q.shape[1], v.shape[2]
    g_cumsum = torch.zeros(Tt, Hv, dtype=torch.float32, device="cuda")
    A = torch.zeros(Tt, Hv, 64, dtype=q.dtype, device="cuda")
    prep = chunk_prepare_blocked_kernel(SM90, "bfloat16", 128)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in (1, 2, 3, 6, 12):
        m = per_sm * sms // Hv + 1
        ci = layout.chunk_idx[:m].contiguous()
        f = lambda: prep(k_p, g_p, beta_p, layout.cu_seqlens, ci, g_cumsum, A)
        f(); torch.cuda.synchronize()
        ms = time_fns([f], "cuda", warmup_ms=25, rep_ms=100)
        rows.append(("prep latency", f"{m * Hv} CTAs ({per_sm}/SM)", "", round(ms * 1e3, 2)))
    from tabulate import tabulate
    print(tabulate(rows, headers=["shape", "kernel", "err", "ms (us for latency)"], tablefmt="github"))


main()
