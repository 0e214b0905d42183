"""Ship compiled kernels with an arch package's wheel, and build them ahead of time.

TileLang keys its cache on the kernel's text, the target, the pass configs and its own
version, not on the GPU (tilelang-notes.md), so kernels compiled for ``sm_90a`` on any
machine load on the H200 without compiling. ``python -m flash_qla_sm90.precompile DIR``
(each arch package has such a module, calling :func:`main`) compiles every static
variant the backend launches (:func:`variants`) into DIR; the package build copies that
directory into the arch package's ``kernel_cache/``; on first load it is copied into a
writable cache directory (TileLang writes staging folders next to its entries). Every
variant compiled is also entered in the kernel index (:mod:`flash_qla_tl.kernel_index`),
which a fresh process loads kernels by.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from . import kernel_index
from .arch import Arch
from .backward import gradient_kernel
from .kernels import (
    chunk_bwd_dh_ws_kernel,
    chunk_bwd_fused_kernel,
    chunk_fwd_ws_kernel,
    chunk_layout_kernel,
    chunk_prepare_kernel,
    group_sum_kernel,
    recurrent_step_kernel,
    zero_tail_kernel,
)
from .kernels.traits import DTYPES, HEAD_DIMS
from .recurrent import step_args


def _user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash-qla" / "tilelang"


def use_shipped_cache(shipped: Path) -> None:
    """Point TileLang at a cache seeded with the kernels an arch package ships in
    ``shipped`` (its ``kernel_cache/``), unless the user chose a cache."""
    if "TILELANG_CACHE_DIR" in os.environ or not shipped.is_dir():
        return
    target = _user_cache_dir()
    stamp = target / f".seeded-{shipped.stat().st_mtime_ns}"
    if not stamp.exists():
        shutil.copytree(shipped, target, dirs_exist_ok=True)
        stamp.touch()
    os.environ["TILELANG_CACHE_DIR"] = str(target)


#: ``chunk_fwd_ws_kernel``'s arguments after has_initial_state, as
#: ``forward.state_output`` passes them (trailing False dropped): (store_h, warmup,
#: h_in_dtype, states_only).
FWD_FLAGS = (
    (False,),                         # no h: inference, or a training forward whose
    #                                   backward recomputes h
    (True,),                          # fp32 h for the caller (output_h)
    (True, False, True),              # h in q's dtype kept for the backward
    (True, False, True, True),        # the backward's recompute of h (no o)
    (False, True),                    # bounded split, no h
    (True, True, True),               # bounded split, h kept for the backward
    (True, True, True, True),         # the bounded backward's recompute of h
)

#: State-pool dtypes of the prefill on a pool (``forward.pool_fwd``), both layouts each.
POOL_DTYPES = ("float32", "bfloat16", "float16")

#: ``chunk_bwd_dh_ws_kernel``'s flags after has_dht, as ``backward.state_grads`` passes
#: them: (warmup, ds1_in_dtype, boundary).
SWEEP_FLAGS = (
    (False, True),                    # unsplit, dS1 in q's dtype
    (True, True),                     # bounded split, dS1 in q's dtype
    (True, False, True),              # the bounded split's boundary walks (no dS1)
)


def variants(arch: Arch):
    """Every (builder, static args) the backend launches on ``arch`` (the args start
    with ``arch``): the chunk layout and padding zeros of varlen calls, then per dtype
    and head dims the prepare, the forward's variants
    (:data:`FWD_FLAGS`) x initial state, the forward on a state pool
    (:data:`POOL_DTYPES` x both layouts), the sweep's (:data:`SWEEP_FLAGS`) x dht, the
    per-chunk gradient kernel, the GVA sum, the fused reverse kernel x dht (where
    ``arch.fused_backward``; else also no boundary sweep, which only feeds it), and the
    decode steps (:func:`_decode_variants`).
    ``tests/sm90/test_host_path.py`` checks that the host path launches nothing else."""
    yield chunk_layout_kernel, (arch,)
    yield zero_tail_kernel, (arch,)
    for dtype in DTYPES:
        for K, V in HEAD_DIMS:
            yield from _chunked_variants(arch, dtype, K, V)
            yield from _decode_variants(arch, dtype, K, V)


def _decode_variants(arch: Arch, dtype: str, K: int, V: int):
    """:func:`variants`' decode steps (``flash_qla.recurrent``) for one dtype and head
    dims: no start state (fp32 final state) or a start state / pool in each of
    :data:`POOL_DTYPES`, each in both layouts, beta in fp32 or in q's dtype."""
    for has_h0, state_dtype in ((False, "float32"), *((True, d) for d in POOL_DTYPES)):
        for v_first in (False, True):
            for beta_dtype in ("float32", dtype):
                yield recurrent_step_kernel, (arch, *step_args(dtype, K, V, has_h0, state_dtype,
                                                               v_first, beta_dtype))


def _chunked_variants(arch: Arch, dtype: str, K: int, V: int):
    """:func:`variants`' kernels of the chunked prefill for one dtype and head dims: the
    per-chunk gradient kernel of ``backward.gradient_kernel`` (the sub-chunk one where the
    states have a row per sub-chunk), the fused kernel and the boundary sweep that feeds it where
    ``arch.fused_backward``."""
    yield chunk_prepare_kernel, (arch, dtype, K)
    yield chunk_prepare_kernel, (arch, dtype, K, dtype)   # beta in q's dtype (inference)
    for has_h0 in (False, True):
        for store_h, *flags in FWD_FLAGS:
            yield chunk_fwd_ws_kernel, (arch, dtype, K, V, has_h0, store_h, *flags)
    for pool_dtype in POOL_DTYPES:                       # prefill on a state pool
        for v_first in (False, True):
            yield chunk_fwd_ws_kernel, (arch, dtype, K, V, True, False, False, False, False,
                                        pool_dtype, v_first)
    for has_dht in (False, True):
        for flags in SWEEP_FLAGS:
            if arch.fused_backward or not flags[2:]:
                yield chunk_bwd_dh_ws_kernel, (arch, dtype, K, V, has_dht, *flags)
    yield gradient_kernel(arch), (arch, dtype, K, V)
    yield group_sum_kernel, (arch, dtype, K)
    if arch.fused_backward:
        for has_dht in (False, True):
            yield chunk_bwd_fused_kernel, (arch, dtype, K, V, has_dht)


def _compile_slice(arches: tuple[Arch, ...], cache_dir: str, jobs: int, index: int) -> int:
    """Compile every ``jobs``-th variant of ``arches`` starting at ``index`` (one worker
    process)."""
    os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(cache_dir)
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    count = 0
    every = [entry for arch in arches for entry in variants(arch)]
    for i, (builder, args) in enumerate(every):
        if i % jobs == index:
            kernel_index.record(builder.index_name, args, builder(*args))
            count += 1
    return count


def compile_all(arches: tuple[Arch, ...], cache_dir: str, jobs: int = 1) -> int:
    """Compile every variant of ``arches`` into ``cache_dir`` (``jobs`` processes);
    returns how many."""
    if jobs <= 1:
        return _compile_slice(arches, cache_dir, 1, 0)
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return sum(pool.map(_compile_slice, [arches] * jobs, [cache_dir] * jobs,
                            [jobs] * jobs, range(jobs)))


def main(arches: dict[str, Callable[[], Arch]], default: str, argv=None) -> None:
    """The command of an arch package's ``precompile`` module: ``arches`` maps the names
    ``--arch`` takes to their arch (resolved only when named; several: comma-separated,
    or "all"); ``default``: ``--arch``'s default."""
    parser = argparse.ArgumentParser(description=compile_all.__doc__)
    parser.add_argument("cache_dir", help="TileLang cache directory to fill")
    parser.add_argument("--jobs", type=int, default=1,
                        help="compiler processes (default 1; the H200 host: 14)")
    parser.add_argument("--arch", default=default,
                        help=f"comma-separated, of {', '.join(arches)}, or 'all' "
                             f"(default: %(default)s)")
    args = parser.parse_args(argv)
    names = list(arches) if args.arch == "all" else args.arch.split(",")
    unknown = [name for name in names if name not in arches]
    if unknown:
        parser.error(f"--arch: unknown {unknown}; known: {', '.join(arches)}")
    count = compile_all(tuple(arches[name]() for name in names), args.cache_dir, args.jobs)
    print(f"compiled {count} kernels ({', '.join(names)}) into {args.cache_dir}")


def package_main(arch_module: str, argv=None) -> None:
    """The command of an arch package's ``precompile`` module: compile the arches of
    ``arch_module`` (its ``ARCHES``; ``--arch`` takes their names, default all, one
    cache entry per target)."""
    import importlib

    arches = importlib.import_module(arch_module).ARCHES
    main({arch.name: (lambda arch=arch: arch) for arch in arches}, default="all", argv=argv)
