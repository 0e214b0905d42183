"""v21 call 5: why bench's eager column (do_bench: L2 flush, start event, one call, end
event) differs from the back-to-back host time, ours vs FlashQLA 0.1.3. For each
workload: do_bench's eager median; the same loop by hand with host timestamps; the torch
profiler (no Python stacks) over 12 iterations of that loop -> OUT/<impl>-<w>.json.gz.
usage: python v21-call5.py IMPL OUT [--flashqla-path DIR]"""
import gzip, json, os, shutil, statistics, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "benchmark"))
import common as C  # noqa: E402
import torch  # noqa: E402

impl_name, out = sys.argv[1], sys.argv[2]
ctx = {"flashqla_path": sys.argv[4] if len(sys.argv) > 4 else None}
impl = C.IMPLS[impl_name]()
impl.load(ctx)
import triton  # noqa: E402
from triton import runtime  # noqa: E402

drv = runtime.driver.active
cache = drv.get_empty_cache_for_benchmark()
rows = []
for key, train in (("4/8@1x8192", True), ("2/4@1x32768", False), ("4/8@1x8192", False)):
    shape = C.Shape.from_key(f"fwd:{key}")
    inp = C.make_inputs(shape, "model", 0, "cuda", with_grads=train)
    a = impl.prepare(inp, ctx, requires_grad=train)
    fn = (lambda: impl.fwd_bwd(a, inp)) if train else (lambda: impl.call(a))
    ctxm = torch.enable_grad() if train else torch.no_grad()
    with ctxm:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        n = 40
        st = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        host, flush_host = [], []
        for i in range(n):
            t0 = time.perf_counter()
            drv.clear_cache(cache)
            t1 = time.perf_counter()
            st[i].record()
            fn()
            en[i].record()
            t2 = time.perf_counter()
            flush_host.append((t1 - t0) * 1e6)
            host.append((t2 - t1) * 1e6)
        torch.cuda.synchronize()
        ev = [s.elapsed_time(e) * 1e3 for s, e in zip(st, en)]
        # back to back, no flush
        s0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        for _ in range(20):
            fn()
        e0.record(); torch.cuda.synchronize()
        b2b = s0.elapsed_time(e0) * 1e3 / 20
        name = f"{impl_name}-{'step' if train else 'fwd'}-{key.replace('/', '-').replace('@', '_')}"
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        with prof:
            for i in range(12):
                drv.clear_cache(cache)
                st[i].record()
                with torch.profiler.record_function("timed_call"):
                    fn()
                en[i].record()
            torch.cuda.synchronize()
        prof.export_chrome_trace(f"/tmp/{name}.json")
        with open(f"/tmp/{name}.json", "rb") as f_in, gzip.open(f"{out}/{name}.json.gz", "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)
    rows.append((name, eager * 1e3, statistics.median(ev), statistics.median(host),
                 statistics.median(flush_host), b2b))
for r in rows:
    print(f"| {r[0]} | do_bench {r[1]:.0f} | by hand: event {r[2]:.0f}, host in call {r[3]:.0f}, "
          f"flush enqueue {r[4]:.0f} | back-to-back {r[5]:.0f} us |")
