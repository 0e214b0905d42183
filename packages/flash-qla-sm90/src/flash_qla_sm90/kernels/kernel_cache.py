"""Ship compiled kernels with the wheel, and build them ahead of time.

TileLang keys its cache on the kernel's text, the target, the pass configs and its own
version, not on the GPU (tilelang-notes.md), so kernels compiled for ``sm_90a`` on any
machine load on the H200 without compiling. ``python -m flash_qla_sm90.kernels.kernel_cache
DIR`` compiles every static variant into DIR; the package build copies that directory
into ``flash_qla_sm90/kernel_cache/``; on first load it is copied into a writable cache
directory (TileLang writes staging folders next to its entries).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "kernel_cache"


def _user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash-qla" / "tilelang"


def use_shipped_cache() -> None:
    """Point TileLang at a cache seeded with the shipped kernels, unless the user chose one."""
    if "TILELANG_CACHE_DIR" in os.environ or not SHIPPED.is_dir():
        return
    target = _user_cache_dir()
    stamp = target / f".seeded-{SHIPPED.stat().st_mtime_ns}"
    if not stamp.exists():
        shutil.copytree(SHIPPED, target, dirs_exist_ok=True)
        stamp.touch()
    os.environ["TILELANG_CACHE_DIR"] = str(target)


def variants(experimental: bool = False):
    """Every (builder, args) the backend can launch; compiled ahead of time. With
    ``experimental``, also the variants of kernels that are off in ``traits`` but have
    GPU tests and tuning entries (so a device session does not compile them)."""
    from . import traits
    from .chunk_bwd_dh import chunk_bwd_dh_kernel
    from .chunk_bwd_dh_ws import chunk_bwd_dh_ws_kernel
    from .chunk_bwd_fused import chunk_bwd_fused_kernel
    from .chunk_bwd_intra import chunk_bwd_intra_kernel, group_sum_kernel
    from .chunk_fwd import chunk_fwd_kernel
    from .chunk_fwd_ws import chunk_fwd_ws_kernel
    from .chunk_prepare import PREPARE_KERNELS
    from .forward import prepare_kernel_name, static_flags

    tilings = [()] + [t for t, on in ((traits.FWD_NARROW, traits.FWD_NARROW_TILING),
                                      (traits.FWD_WIDE, traits.FWD_WIDE_TILING)) if on]
    for dtype in traits.DTYPES:
        for K, V in traits.HEAD_DIMS:
            for name, prepare in PREPARE_KERNELS.items():
                if experimental or name == prepare_kernel_name():
                    yield prepare, (dtype, K)
            for has_h0 in (False, True):
                for store_h in (False, True):
                    for tiling in tilings:
                        yield chunk_fwd_kernel, (dtype, K, V, has_h0, store_h, *tiling)
                    for transposed in _transposed_builders(K, V, experimental):
                        yield transposed, (dtype, K, V, has_h0, store_h)
                        if transposed is chunk_fwd_ws_kernel:                  # warm-up
                            yield transposed, (dtype, K, V, has_h0, store_h, True)
                            if store_h:    # the backward's recompute of h (no o):
                                for h_in_dtype in (False, True):      # warm-up
                                    yield transposed, (dtype, K, V, has_h0, True, True,
                                                       h_in_dtype, True)
                                for h_in_dtype in (False, True):      # unsplit
                                    yield transposed, (dtype, K, V, has_h0, True, False,
                                                       h_in_dtype, True)
                                # the training forward keeping h in dtype (with o)
                                for warmup in (False, True):
                                    yield transposed, (dtype, K, V, has_h0, True, warmup,
                                                       True)
            ws_dh = (K, V) == (128, 128) and traits.BWD_DH_AUX_WARPGROUP
            for has_dht in (False, True):
                if ws_dh or (experimental and (K, V) == (128, 128)):
                    for flags in ((), (True,), (True, True), (False, True)):
                        yield chunk_bwd_dh_ws_kernel, (dtype, K, V, has_dht, *flags)
                        # (warm-up, dS1 in dtype): unsplit / bounded, fp32 / dtype
                if ws_dh and not experimental:
                    continue
                yield chunk_bwd_dh_kernel, (dtype, K, V, has_dht)
                if traits.FWD_NARROW_TILING:
                    yield chunk_bwd_dh_kernel, (dtype, K, V, has_dht, traits.BLOCK_V_NARROW)
                if (K, V) == (128, 128) and traits.FWD_AUX_WARPGROUP:  # bounded split
                    for block_v in (traits.BLOCK_V, traits.BLOCK_V_NARROW):
                        yield chunk_bwd_dh_kernel, (dtype, K, V, has_dht, block_v, True)
                        yield chunk_bwd_dh_kernel, (dtype, K, V, has_dht, block_v, True,
                                                    True)               # dS1 in dtype
            # qk_in_dtype False: per-head fp32 dq / dk, only without BWD_GVA_GRADS_IN_DTYPE
            for qk_in_dtype in (True,) if traits.BWD_GVA_GRADS_IN_DTYPE else (False, True):
                for states_in_dtype in (False, True):           # True: h, dS1 in dtype
                    yield chunk_bwd_intra_kernel, (dtype, K, V, *static_flags(
                        qk_in_dtype, states_in_dtype))
            if traits.BWD_GVA_GRADS_IN_DTYPE:                   # the GVA sum of dq, dk
                yield group_sum_kernel, (dtype, K)
            if (K, V) == (128, 128) and (traits.BWD_FUSED or experimental):
                for qk_in_dtype in (True,) if traits.BWD_GVA_GRADS_IN_DTYPE else (False, True):
                    for has_dht in (False, True):
                        yield chunk_bwd_fused_kernel, (dtype, K, V, has_dht,
                                                       *static_flags(qk_in_dtype))
                for has_dht in (False, True):    # the bounded split's boundary sweep
                    yield chunk_bwd_dh_ws_kernel, (dtype, K, V, has_dht, True, False, True)


def _transposed_builders(K: int, V: int, experimental: bool) -> tuple:
    """The transposed-state forwards to compile: the one ``traits`` enables, or (with
    ``experimental``) both ``chunk_fwd_t`` and ``chunk_fwd_ws``; K = V = 128 only."""
    from . import traits
    from .forward import TRANSPOSED_KERNELS, transposed_kernel

    if (K, V) != (128, 128):
        return ()
    if experimental:
        return tuple(TRANSPOSED_KERNELS.values())
    if not traits.FWD_TRANSPOSED:
        return ()
    return (TRANSPOSED_KERNELS[transposed_kernel()],)


def _compile_slice(cache_dir: str, experimental: bool, jobs: int, index: int) -> int:
    """Compile every ``jobs``-th variant starting at ``index`` (one worker process)."""
    os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(cache_dir)
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    count = 0
    for i, (builder, args) in enumerate(variants(experimental)):
        if i % jobs == index:
            builder(*args)
            count += 1
    return count


def compile_all(cache_dir: str, experimental: bool = False, jobs: int = 1) -> int:
    """Compile every variant into ``cache_dir`` (``jobs`` processes); returns how many."""
    if jobs <= 1:
        return _compile_slice(cache_dir, experimental, 1, 0)
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        counts = pool.map(_compile_slice, [cache_dir] * jobs, [experimental] * jobs,
                          [jobs] * jobs, range(jobs))
        return sum(counts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=compile_all.__doc__)
    parser.add_argument("cache_dir", help="TileLang cache directory to fill")
    parser.add_argument("--experimental", action="store_true",
                        help="also the kernels that are off in traits (device sessions)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="compiler processes (default 1; the H200 host: 14)")
    args = parser.parse_args(argv)
    count = compile_all(args.cache_dir, args.experimental, args.jobs)
    print(f"compiled {count} kernels into {args.cache_dir}")


if __name__ == "__main__":
    main()
