"""Compile-only tests of every Hopper kernel family: no GPU needed, nvcc and TileLang are.

They lower each kernel for the explicit sm_90a target into a fresh TileLang cache (so a
warm cache cannot hide a broken build) and check that the generated CUDA uses the Hopper
paths the design relies on: WGMMA for the GEMMs and TMA for the tile loads, and that
every offset into a token-sized tensor is computed in 64 bits.
"""

from __future__ import annotations

import re

import pytest

tilelang = pytest.importorskip("tilelang", reason="TileLang is not installed")
pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TILELANG_CACHE_DIR", str(tmp_path_factory.mktemp("tilelang-cache")))
    mp.setenv("TILELANG_PRINT_ON_COMPILATION", "0")
    yield
    mp.undo()


def _source(builder, *args) -> str:
    return builder(*args).get_kernel_source()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepare_kernel_compiles_to_wgmma(dtype):
    # one chunk per CTA and no loop to pipeline: plain vector loads, no TMA ring
    from flash_qla_sm90.kernels.chunk_prepare import chunk_prepare_kernel

    src = _source(chunk_prepare_kernel, dtype, 128)
    assert "wgmma" in src


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_blocked_prepare_runs_its_products_on_fp16_wgmma(dtype):
    """chunk_prepare_blocked: K K^T in the input dtype, then the four products of the
    blocked inverse with fp16 operands, all on WGMMA (no mma.sync fallback)."""
    from flash_qla_sm90.kernels.chunk_prepare import chunk_prepare_blocked_kernel

    src = _source(chunk_prepare_blocked_kernel, dtype, 128)
    kinds = {"bfloat16": "kBFloat16", "float16": "kFloat16"}
    assert src.count(f"tl::wgmma_ss<tl::DataType::{kinds[dtype]}") >= 1       # K K^T
    assert src.count("tl::wgmma_ss<tl::DataType::kFloat16, tl::DataType::kFloat16") >= 4
    assert "mma_sync" not in src


@pytest.mark.parametrize("dtype, has_h0, store_h", [("bfloat16", True, True),
                                                    ("float16", False, False)],
                         ids=["bf16-h0-h", "fp16"])
def test_fused_forward_compiles_to_wgmma_and_tma(dtype, has_h0, store_h):
    from flash_qla_sm90.kernels.chunk_fwd import chunk_fwd_kernel

    src = _source(chunk_fwd_kernel, dtype, 128, 128, has_h0, store_h)
    assert "wgmma" in src
    assert "tma_load" in src
    assert "mbarrier" in src          # producer/consumer pipeline on transaction barriers


def test_every_variant_is_listed_for_the_shipped_cache():
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.kernel_cache import variants

    names = {(builder.__name__ if hasattr(builder, "__name__") else str(builder), args)
             for builder, args in variants()}
    fwd_tilings = 1 + traits.FWD_NARROW_TILING + traits.FWD_WIDE_TILING + traits.FWD_TRANSPOSED
    warmup = traits.FWD_TRANSPOSED and traits.FWD_AUX_WARPGROUP   # the bounded split
    # per dtype: prepare, chunk_fwd x has_h0 x store_h x tiling, the warm-up ws x has_h0
    # x store_h, the backward's states-only ws x has_h0 x (warm-up, unsplit) x h dtype,
    # the training forward keeping h in dtype (with o) x has_h0 x (warm-up, unsplit),
    # the dh sweep (below), intra x state dtype (dq / dk per head in q's dtype with
    # BWD_GVA_GRADS_IN_DTYPE, else also in fp32), the group sum (with it), the fused
    # reverse kernel
    if traits.BWD_DH_AUX_WARPGROUP:          # chunk_bwd_dh_ws x has_dht x 4 flag sets
        dh = 8
    else:                                    # chunk_bwd_dh x has_dht x tiling (+ warm-up
        dh = 2 * (1 + traits.FWD_NARROW_TILING) + 8 * warmup   # x 2 tilings x dS1 dtype)
    intra = 2 * (1 + (not traits.BWD_GVA_GRADS_IN_DTYPE))
    group_sum = int(traits.BWD_GVA_GRADS_IN_DTYPE)     # the GVA sum of per-head dq / dk
    # the fused reverse kernel x has_dht (x dq / dk dtype as intra), its boundary sweep
    fused = (intra + 2) * traits.BWD_FUSED
    assert len(names) == len(traits.DTYPES) * (1 + 4 * fwd_tilings + 16 * warmup + dh + intra
                                               + group_sum + fused)


def test_experimental_variants_add_the_kernels_that_are_off():
    """``variants(experimental=True)`` (the device bundle) holds both transposed-state
    forwards in every variant and both prepare kernels, whatever ``traits`` enables."""
    from flash_qla_sm90.kernels import traits
    from flash_qla_sm90.kernels.chunk_fwd_t import chunk_fwd_t_kernel
    from flash_qla_sm90.kernels.chunk_fwd_ws import chunk_fwd_ws_kernel
    from flash_qla_sm90.kernels.chunk_prepare import PREPARE_KERNELS
    from flash_qla_sm90.kernels.kernel_cache import variants

    def transposed(experimental):
        return {(id(b), args) for b, args in variants(experimental)
                if b is chunk_fwd_t_kernel or b is chunk_fwd_ws_kernel}

    both = transposed(True)
    # (kernel x has_h0 x store_h, + ws's warm-up x has_h0 x store_h, + its states-only
    # variants x has_h0 x (warm-up, unsplit) x h dtype, + its h-in-dtype forwards with o
    # x has_h0 x (warm-up, unsplit)) x dtype
    assert len(both) == (2 * 4 + 4 + 8 + 4) * len(traits.DTYPES)
    assert transposed(False) <= both
    builders = [b for b, _ in variants(True)]
    assert all(b in builders for b in PREPARE_KERNELS.values())      # both prepare kernels


def test_transposed_forward_keeps_the_state_chain_in_registers():
    """chunk_fwd_t: the state GEMMs take register A operands (wgmma_rs), the chunk tiles
    come by TMA, and the producer hands its registers to the state warpgroups."""
    from flash_qla_sm90.kernels.chunk_fwd_t import chunk_fwd_t_kernel

    src = _source(chunk_fwd_t_kernel, "bfloat16", 128, 128, True, True)
    assert src.count("tl::wgmma_rs<") >= 5
    assert "tma_load" in src
    assert "warpgroup_reg_alloc<240>" in src and "warpgroup_reg_dealloc<24>" in src


def test_aux_warpgroup_forward_never_serialises_its_roles():
    """chunk_fwd_ws: the state chain is register-A WGMMAs; the roles meet only on the
    slot mbarriers (the one CTA-wide barrier is the barrier initialisation)."""
    from flash_qla_sm90.kernels.chunk_fwd_ws import chunk_fwd_ws_kernel

    src = _source(chunk_fwd_ws_kernel, "bfloat16", 128, 128, True, True)
    assert src.count("tl::wgmma_rs<") >= 5
    assert src.count("__syncthreads()") == 1
    assert src.count("].arrive()") == 4      # full (aux), empty (state), loaded (aux: the
    #                                              first chunk's and the loop's)
    assert "tma_load" in src and "cp_async" not in src  # the aux's tiles arrive by TMA


def _shared_spans(compiled, allow=()) -> dict:
    """``{buffer: (first byte, end)}`` of a compiled kernel's dynamic shared memory: the
    offsets from the generated CUDA, the sizes from the buffers' shapes in its TIR
    (``allow``: buffers TileLang adds while lowering, e.g. reduction workspaces, left
    out)."""
    import math

    import tvm

    src = compiled.get_kernel_source()
    offsets = {name: int(off) for name, off in re.findall(
        r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src)}
    sizes = {}

    def visit(node):
        for buf in getattr(node, "alloc_buffers", ()):
            if buf.scope() == "shared.dyn":
                sizes[buf.name] = math.prod(int(x) for x in buf.shape) * buf.dtype.bits // 8

    tvm.tirx.stmt_functor.post_order_visit(compiled.prim_func.body, visit)
    offsets = {name: off for name, off in offsets.items() if name not in allow}
    assert set(offsets) <= set(sizes), (offsets, sizes)        # unused buffers get no bytes
    return {name: (off, off + sizes[name]) for name, off in offsets.items()}


@pytest.mark.parametrize(("kernel", "stage", "out"),
                         [("fwd_ws_warmup_h_dtype", "h_s", "h_out"),
                          ("fwd_ws_warmup_states_dtype", "h_s", "h_out"),
                          ("bwd_dh_ws_warmup_dtype", "ds1_s", "dS1")])
def test_staged_state_store_has_shared_memory_of_its_own(kernel, stage, out, tmp_path):
    """The warp-specialised sweeps storing h / dS1 in q's dtype stage it in a shared
    [K, V] tile and store it by TMA (``tile_ops.store_staged``; no element-wise stores
    from the registers), and that tile gets bytes of its own: TileLang's planner reuses
    the bytes of a buffer whose last use comes earlier in program order, and the role
    blocks run at once (v17's race)."""
    builder, args = _variant(kernel)
    compiled = builder(*args)
    src = compiled.get_kernel_source()
    assert f"tma_store({out}_desc" in src and not re.search(rf"\b{out}\[", src)
    spans = _shared_spans(compiled)
    lo, hi = spans[stage]
    overlapping = {name: span for name, span in spans.items()
                   if name != stage and span[0] < hi and lo < span[1]}
    assert hi - lo == 128 * 128 * 2 and not overlapping, (stage, spans)
    # the 32 KB tile takes these kernels to the sm_90 block limit: dynamic + static
    # (the mbarriers, padded to the dynamic buffer's 1024-byte alignment) <= 227 KB
    static = int(re.search(r"(\d+) bytes smem", _ptxas_report(src, tmp_path)).group(1))
    dynamic = max(_dynamic_smem(builder(*args).get_host_source()))
    assert dynamic + static <= _SM90_MAX_DYNAMIC_SMEM, (dynamic, static)


def test_fused_reverse_kernel_roles_keep_to_their_own_resources(tmp_path):
    """chunk_bwd_fused: four warpgroups by role meeting on mbarriers. Every shared buffer
    has bytes of its own (reuse is off: role blocks run at once) and they fit the sm_90
    block with the mbarriers; the cross-warp reductions (TileLang's, named barriers 1
    and 2) are all in the intra role's block, so no two roles meet on those ids; tiles
    load by TMA; ptxas keeps every WGMMA chain in flight."""
    from flash_qla_sm90.kernels import chunk_bwd_fused

    builder, args = _variant("bwd_fused")
    compiled = builder(*args)
    src = compiled.get_kernel_source()
    offsets = sorted((int(off), name) for name, off in re.findall(
        r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src))
    reductions = [name for _, name in offsets if name.startswith("workspace")]
    assert len(reductions) == 2                  # the intra role's two column sums
    spans = _shared_spans(compiled, allow=reductions)
    ends = [spans.get(name, (off, off + 1))[1] for off, name in offsets]
    assert all(end <= nxt for end, (nxt, _) in zip(ends, offsets[1:])), offsets
    report = _ptxas_report(src, tmp_path)
    static = int(re.search(r"(\d+) bytes smem", report).group(1))
    dynamic = max(_dynamic_smem(compiled.get_host_source()))
    assert dynamic + static <= _SM90_MAX_DYNAMIC_SMEM, (dynamic, static)
    assert "C7512" not in report and "serialized" not in report
    blocks = re.split(r"tl::warpgroup_reg_(?:alloc|dealloc)<(\d+)>", src)
    regs = [int(r) for r in blocks[1::2]]
    assert regs == [chunk_bwd_fused.INTRA_REGS, chunk_bwd_fused.CHAIN_REGS,
                    chunk_bwd_fused.STATE_REGS, chunk_bwd_fused.LOAD_REGS]
    cross_warp = [len(re.findall(r"AllReduce<tl::SumOp, (?:64|128),", b)) for b in blocks[::2]]
    assert cross_warp[1] > 0 and sum(cross_warp) == cross_warp[1], cross_warp  # intra only
    assert src.count("__syncthreads()") == 1 and "tma_load" in src and "cp_async" not in src


def test_states_only_forward_skips_o():
    """chunk_fwd_ws with ``states_only`` (the backward's recompute of h): three state
    WGMMAs per chunk, no Q K^T on the aux warpgroup, and o never written."""
    builder, args = _variant("fwd_ws_states")
    src = _source(builder, *args)
    assert src.count("tl::wgmma_rs<") == 3 and "wgmma_ss<" not in src
    assert not re.search(r"\bo\[", src)


def test_aux_warpgroup_sweep_keeps_ds_in_registers(tmp_path):
    """chunk_bwd_dh_ws: the dS chain is register-A WGMMAs (dS1^T K^T, dU^T Ag, (E dX)^T
    K), the roles meet only on the slot mbarriers, the tiles load by TMA, and ptxas
    spills nothing at its setmaxnreg budgets (the forward's 208 / 88 spilled here)."""
    builder, args = _variant("bwd_dh_ws_warmup")
    src = _source(builder, *args)
    assert src.count("tl::wgmma_rs<") >= 3
    assert src.count("__syncthreads()") == 1
    assert src.count("].arrive()") == 4      # full, empty, loaded (first chunk's, loop's)
    assert "tma_load" in src and "cp_async" not in src
    assert "warpgroup_reg_alloc<192>" in src and "warpgroup_reg_dealloc<120>" in src
    assert re.search(r"\b0 bytes spill stores", _ptxas_report(src, tmp_path))


def _ptxas_report(src: str, tmp_path) -> str:
    """ptxas's verbose report for a generated kernel (nvcc -cubin for sm_90a with the
    include paths TileLang compiles with)."""
    import subprocess

    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    from tests.conftest import _nvcc

    cu = tmp_path / "kernel.cu"
    cu.write_text(src)
    out = subprocess.run(
        [_nvcc(), "-std=c++17", "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin"),
         "--ptxas-options=-v", "-I" + CUTLASS_INCLUDE_DIR, "-I" + TILELANG_TEMPLATE_PATH,
         str(cu)], capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


_DIMS = ("bfloat16", 128, 128)
# name -> (module of flash_qla_sm90.kernels, builder, static args): bf16, K = V = 128;
# ``_h``: stores h
_VARIANTS = {
    "prepare": ("chunk_prepare", "chunk_prepare_kernel", ("bfloat16", 128)),
    "prepare_blocked": ("chunk_prepare", "chunk_prepare_blocked_kernel", ("bfloat16", 128)),
    "fwd": ("chunk_fwd", "chunk_fwd_kernel", (*_DIMS, True, True)),
    "fwd_wide": ("chunk_fwd", "chunk_fwd_kernel", (*_DIMS, True, True, 128)),   # BLOCK_V 128
    "fwd_t": ("chunk_fwd_t", "chunk_fwd_t_kernel", (*_DIMS, True, False)),
    "fwd_t_h": ("chunk_fwd_t", "chunk_fwd_t_kernel", (*_DIMS, True, True)),
    "fwd_ws": ("chunk_fwd_ws", "chunk_fwd_ws_kernel", (*_DIMS, False, False)),
    "fwd_ws_h": ("chunk_fwd_ws", "chunk_fwd_ws_kernel", (*_DIMS, True, True)),
    "fwd_ws_warmup": ("chunk_fwd_ws", "chunk_fwd_ws_kernel", (*_DIMS, True, False, True)),
    "fwd_ws_warmup_h": ("chunk_fwd_ws", "chunk_fwd_ws_kernel", (*_DIMS, True, True, True)),
    "fwd_ws_warmup_h_dtype": ("chunk_fwd_ws", "chunk_fwd_ws_kernel",
                              (*_DIMS, True, True, True, True)),
    "fwd_ws_states": ("chunk_fwd_ws", "chunk_fwd_ws_kernel",
                      (*_DIMS, True, True, False, False, True)),
    "fwd_ws_warmup_states_dtype": ("chunk_fwd_ws", "chunk_fwd_ws_kernel",
                                   (*_DIMS, True, True, True, True, True)),
    "bwd_dh": ("chunk_bwd_dh", "chunk_bwd_dh_kernel", (*_DIMS, True)),
    "bwd_dh_warmup": ("chunk_bwd_dh", "chunk_bwd_dh_kernel", (*_DIMS, True, 64, True)),
    "bwd_dh_warmup_dtype": ("chunk_bwd_dh", "chunk_bwd_dh_kernel",
                            (*_DIMS, True, 64, True, True)),
    "bwd_dh_ws": ("chunk_bwd_dh_ws", "chunk_bwd_dh_ws_kernel", (*_DIMS, True)),
    "bwd_dh_ws_warmup": ("chunk_bwd_dh_ws", "chunk_bwd_dh_ws_kernel", (*_DIMS, True, True)),
    "bwd_dh_ws_warmup_dtype": ("chunk_bwd_dh_ws", "chunk_bwd_dh_ws_kernel",
                               (*_DIMS, True, True, True)),
    "bwd_intra": ("chunk_bwd_intra", "chunk_bwd_intra_kernel", _DIMS),
    "bwd_intra_dtype": ("chunk_bwd_intra", "chunk_bwd_intra_kernel", (*_DIMS, True)),
    "bwd_intra_states_dtype": ("chunk_bwd_intra", "chunk_bwd_intra_kernel",
                               (*_DIMS, True, True)),
    "bwd_dh_ws_boundary": ("chunk_bwd_dh_ws", "chunk_bwd_dh_ws_kernel",
                           (*_DIMS, True, True, False, True)),
    "bwd_fused": ("chunk_bwd_fused", "chunk_bwd_fused_kernel", (*_DIMS, True, True)),
    "bwd_fused_no_dht": ("chunk_bwd_fused", "chunk_bwd_fused_kernel", (*_DIMS, False, True)),
}


def _variant(name: str) -> tuple:
    """``(builder, args)`` of a kernel variant the tests below compile, by name (the
    kernel module is imported here, not at collection)."""
    import importlib

    module, builder, args = _VARIANTS[name]
    return getattr(importlib.import_module(f"flash_qla_sm90.kernels.{module}"), builder), args


@pytest.mark.parametrize("kernel", ["fwd_t", "fwd_ws", "fwd_ws_warmup", "prepare_blocked", "bwd_dh",
                                    "bwd_dh_warmup", "bwd_intra", "bwd_intra_dtype",
                                    "fwd_ws_warmup_h_dtype", "bwd_dh_warmup_dtype",
                                    "bwd_intra_states_dtype", "bwd_dh_ws",
                                    "bwd_dh_ws_warmup_dtype",
                                    "fwd_ws_states", "fwd_ws_warmup_states_dtype"])
def test_wgmma_chains_are_not_serialised(kernel, tmp_path):
    """ptxas keeps the WGMMA k-steps of these kernels in flight together: no C7512
    ("wgmma.mma_async instructions are serialized"), which makes every 16-deep step wait
    for the previous one. chunk_fwd_ws has it (168 registers for 384 threads; Nsight
    Compute on the H200: 30% of its state warpgroups' samples at those waits), but
    lifting it with setmaxnreg 208 / 88 measured 2.4% slower, the aux side being the
    bound (docs/perf-notes.md, v4), so it is not listed here."""
    builder, args = _variant(kernel)
    report = _ptxas_report(_source(builder, *args), tmp_path)
    assert "Used" in report, report[-2000:]
    assert "C7512" not in report and "serialized" not in report


def test_backward_dh_kernel_compiles_to_wgmma_and_tma():
    from flash_qla_sm90.kernels.chunk_bwd_dh import chunk_bwd_dh_kernel

    src = _source(chunk_bwd_dh_kernel, "bfloat16", 128, 128, True)
    assert "wgmma" in src
    assert "tma_load" in src


# qk_grads_in_dtype=False (per-head fp32 dq / dk) is shipped only without
# traits.BWD_GVA_GRADS_IN_DTYPE: the test compiles what the cache ships
@pytest.mark.parametrize("qk_grads_in_dtype", [True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_intra_kernel_compiles_to_wgmma(dtype, qk_grads_in_dtype):
    # one chunk per CTA, no loop to pipeline: guarded cp.async tile loads, WGMMA GEMMs
    from flash_qla_sm90.kernels.chunk_bwd_intra import chunk_bwd_intra_kernel

    src = _source(chunk_bwd_intra_kernel, dtype, 128, 128,
                  *((True,) if qk_grads_in_dtype else ()))       # the shipped variants' keys
    assert "wgmma" in src
    # the dq / dk pointers take the requested element type
    ctype = {"bfloat16": "bfloat16_t", "float16": "half_t"}[dtype] if qk_grads_in_dtype \
        else "float"
    assert re.search(rf"{ctype}\*\s*__restrict__\s+dq\b", src), src[:2000]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_group_sum_kernel_reads_and_writes_16_bytes(dtype):
    """The GVA sum is a bandwidth kernel: every load of the per-head grads and every
    store of the sum moves 16 bytes (8 elements) per thread, accumulated in fp32."""
    from flash_qla_sm90.kernels.chunk_bwd_intra import group_sum_kernel

    src = _source(group_sum_kernel, dtype, 128)
    assert re.search(r"\*\(uint4\*\)\(x_local_cast", src), src[:3000]
    assert re.search(r"\*\(uint4\*\)\(out \+", src), src[:3000]
    assert "float acc[" in src


def test_intra_kernel_reductions_are_batched():
    """chunk_bwd_intra exchanges every row / column sum a thread owns in one AllReduce
    (one barrier pair), not one per element."""
    builder, args = _variant("bwd_intra_states_dtype")
    src = _source(builder, *args)
    assert "AllReduce" in src and "::run_batch(" in src
    assert not re.search(r"AllReduce<[^;]*>::run\(", src)


# Per-sequence index tensors ([N + 1] or [NTmax, 2] entries) may be indexed in 32 bits.
_SMALL = {"cu_seqlens", "chunk_offsets", "chunk_idx", "seq_start", "seq_index", "seq_end"}


def _global_accesses(src: str):
    """(pointer, index expression) of every ``p[...]`` and ``p + (...)`` in the kernel body,
    for each pointer argument ``T* __restrict__ p`` of the kernel."""
    body = src[src.index("__global__"):]
    params = re.findall(r"\*\s*__restrict__\s+(\w+)", body[:body.index("{")])
    found = []
    pattern = r"\b(" + "|".join(params) + r")(\[|\s*\+\s*\()"
    for m in re.finditer(pattern, body):
        opening = m.group(2)[-1]
        closing = {"[": "]", "(": ")"}[opening]
        i, depth = m.end(), 1
        while depth:
            depth += (body[i] == opening) - (body[i] == closing)
            i += 1
        found.append((m.group(1), body[m.end():i - 1]))
    return found


# every variant above (each compiled once: the cache is per module)
_ALL_VARIANTS = list(_VARIANTS)


@pytest.mark.parametrize("kernel", _ALL_VARIANTS)
def test_global_indexing_is_64_bit(kernel):
    """Offsets into token-sized tensors are computed in int64 in the generated CUDA, so
    inputs past 2^31 elements index correctly (issue: no 32-bit offset overflow)."""
    builder, args = _variant(kernel)
    accesses = [(p, e) for p, e in _global_accesses(_source(builder, *args)) if p not in _SMALL]
    assert accesses, "no global access found: the pattern no longer matches the codegen"
    narrow = [(p, e[:100]) for p, e in accesses if "int64_t" not in e]
    assert not narrow, narrow


# the most dynamic shared memory one CTA may opt in to on sm_90 (227 KB)
_SM90_MAX_DYNAMIC_SMEM = 232448


def _dynamic_smem(host_src: str) -> list:
    """Dynamic shared memory bytes of each kernel launch in TileLang's host code: the last
    argument packed before each ``TVMFFIFunctionCall(<kernel>_packed, ..., n, ...)``
    (the runtime's own calls, named ``__...``, are not launches)."""
    sizes, start = [], 0
    launch = r"TVMFFIFunctionCall\((?!__)\w+_packed, \(TVMFFIAny\*\) stack_ffi_any, (\d+),"
    for call in re.finditer(launch, host_src):
        last = int(call.group(1)) - 1
        slots = re.findall(rf"\[{last}\]\.v_int64\) = \(\(int64_t\)(\d+)\);",
                           host_src[start:call.start()])
        assert slots, f"launch {call.group(0)!r}: no literal shared-memory size before it"
        sizes.append(int(slots[-1]))
        start = call.end()
    return sizes


@pytest.mark.parametrize("kernel", _ALL_VARIANTS)
def test_shared_memory_fits_one_sm90_block(kernel):
    """Every kernel asks for at most 227 KB of dynamic shared memory, the sm_90 opt-in
    limit: past it the launch fails at run time ("Failed to set the allowed dynamic
    shared memory size"), which no compile step reports. TileLang gives every reduction
    its own workspace, so batching reductions (chunk_bwd_intra) can cross it. (All 108
    shipped variants were checked once: the largest is chunk_fwd at BLOCK_V 128 in fp16,
    230,400 B; docs/perf-notes.md v11.)"""
    builder, args = _variant(kernel)
    sizes = _dynamic_smem(builder(*args).get_host_source())
    assert sizes, "no kernel launch found: the pattern no longer matches the host code"
    assert max(sizes) <= _SM90_MAX_DYNAMIC_SMEM, sizes
