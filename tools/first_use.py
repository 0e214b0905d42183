"""Where the first call of a fresh process spends its time (GPU debugging aid, sm90).

Run it in a new process with the kernel cache filled (``TILELANG_CACHE_DIR``): it prints,
in seconds, ``import torch``, the CUDA context, ``import flash_qla``, the backend's import
(TileLang and the kernel modules), torch's own import for a backward given gradient
tensors (timed apart: it is not this library's), then the first forward and the first
training step of one shape (its forward and its backward timed apart), with the time
spent getting each kernel (from the kernel index, or the builder call: program built,
cache key hashed, module loaded from disk) and the modules each phase imported listed
apart, and whether TileLang's Python package was imported.

usage: python tools/first_use.py [--shape 4/8@1x8192] [--step-first]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402

T_TORCH = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4/8@1x8192", help="HK/HV@LAYOUT (the benchmark's keys)")
    ap.add_argument("--step-first", action="store_true",
                    help="time the training step before any forward (its own first call)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: tools/first_use.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    phases = {"import torch": T_TORCH - T0}

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        phases[name] = time.perf_counter() - t
        return out

    timed("CUDA context", lambda: torch.zeros(1, device="cuda"))
    # torch's own first-use cost, paid by any library's first backward that is given
    # gradient tensors (torch.autograd's _make_grads imports the symbolic-shapes module,
    # and with it sympy: 0.8 s on a 2-core CPU host, ~2.7 s on the H100 hosts); a
    # training loop's loss.backward() (no gradient tensor) does not import it
    timed("torch's import for backward(grads)",
          lambda: __import__("torch.fx.experimental.symbolic_shapes"))
    flash_qla = timed("import flash_qla", lambda: __import__("flash_qla"))
    timed("import backend (host modules)", lambda: __import__("flash_qla_tl.backend"))

    from flash_qla_tl import launch
    builds: list[tuple[str, float]] = []
    build = launch.launcher

    def launcher(builder, *static):
        key = (id(builder), static)
        if key in launch._LAUNCHERS:
            return build(builder, *static)
        t = time.perf_counter()
        out = build(builder, *static)
        builds.append((f"{getattr(builder, '__name__', builder)}{static[1:]}",
                       time.perf_counter() - t))
        return out
    launch.launcher = launcher
    for module in ("forward", "backward"):
        mod = sys.modules.get(f"flash_qla_tl.{module}")
        if mod is not None and hasattr(mod, "launcher"):
            mod.launcher = launcher

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmark"))
    import common as C

    shape = C.Shape.from_key(f"fwd:{args.shape}")
    inp = C.make_inputs(shape, "model", 0, "cuda", with_grads=True)
    impl = C.IMPLS["ours"]()
    impl.load({})
    a = impl.prepare(inp, {})
    a_grad = impl.prepare(inp, {}, requires_grad=True)
    outs = {}

    def forward_with_grad():
        outs["o"] = impl.canon(impl.call(a_grad), a_grad)

    def backward():
        torch.autograd.grad(outs.pop("o"), impl.leaves(a_grad), (inp["do"], inp["dht"]))

    step = (("first training step: forward", forward_with_grad),
            ("first training step: backward", backward))
    first = (("first forward", lambda: impl.call(a)),)
    for name, fn in (step + first if args.step_first else first + step):
        n, before = len(builds), set(sys.modules)
        timed(name, fn)
        phases[f"  of which kernels got ({len(builds) - n})"] = sum(s for _, s in builds[n:])
        new = sorted({m.split(".")[0] for m in set(sys.modules) - before})
        print(f"{name}: {len(set(sys.modules) - before)} modules imported "
              f"(packages: {', '.join(new) or 'none'})")
    timed("second training step", lambda: impl.fwd_bwd(a_grad, inp))
    phases["process total"] = time.perf_counter() - T0
    print(f"tilelang imported: {'tilelang' in sys.modules}")
    for name, s in builds:
        print(f"kernel {name}: {s:.3f} s")
    print(f"flash_qla {getattr(flash_qla, '__version__', '?')}, shape {args.shape}")
    for name, s in phases.items():
        print(f"{name:40s} {s:7.3f} s")


if __name__ == "__main__":
    main()
