"""Compile-only tests of every Hopper kernel family: no GPU needed, nvcc and TileLang are.

They lower each kernel for the explicit sm_90a target into a fresh TileLang cache (so a
warm cache cannot hide a broken build) and check that the generated CUDA uses the Hopper
paths the design relies on: WGMMA for the GEMMs and TMA for the tile loads, and that
every offset into a token-sized tensor is computed in 64 bits.
"""

from __future__ import annotations

import re

import pytest

from flash_qla_sm90.arch import SM90
from tests.kernel_build import VARIANTS, dynamic_smem, narrow_accesses, ptxas_report, variant

tilelang = pytest.importorskip("tilelang", reason="TileLang is not installed")
pytestmark = [pytest.mark.nvcc, pytest.mark.usefixtures("fresh_tilelang_cache")]


def _source(builder, *args) -> str:
    """The CUDA of ``builder`` built for SM90 with static ``args``."""
    return builder(SM90, *args).get_kernel_source()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepare_runs_kkt_on_wgmma_and_the_inverse_on_register_chained_mma(dtype):
    """chunk_prepare: K K^T in the input dtype on WGMMA, then the inverse of
    ``unit_lower_inverse`` (one call; its products fp16 ``mma.sync`` fed by ``ldmatrix``,
    no WGMMA of fp16 operands)."""
    from flash_qla_tl.kernels.chunk_cumsum_inverse import chunk_prepare_kernel

    src = _source(chunk_prepare_kernel, dtype, 128)
    kinds = {"bfloat16": "kBFloat16", "float16": "kFloat16"}
    assert src.count("tl::wgmma_ss<") == 1                                   # K K^T
    assert f"tl::wgmma_ss<tl::DataType::{kinds[dtype]}" in src
    assert src.count("fqla_inverse::inverse64<") == 1                     # one call
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in src


def _cta_barriers(src: str) -> tuple[int, int]:
    """``__syncthreads()`` of a warp-specialised kernel before its roles split (at the
    aux's setmaxnreg) and after."""
    head, _, roles = src.partition("tl::warpgroup_reg_dealloc<")
    return head.count("__syncthreads()"), roles.count("__syncthreads()")


def test_aux_warpgroup_forward_never_serialises_its_roles():
    """chunk_fwd_ws: the state chain is register-A WGMMAs; the roles meet only on the
    slot mbarriers (the CTA-wide barriers come before the roles split: the mbarriers'
    initialisation and the o tile's first write)."""
    from flash_qla_tl.kernels.chunk_state_output import chunk_fwd_ws_kernel

    src = _source(chunk_fwd_ws_kernel, "bfloat16", 128, 128, True, True)
    assert src.count("tl::wgmma_rs<") >= 5
    assert _cta_barriers(src) == (2, 0)
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
    builder, args = variant(kernel)
    compiled = builder(SM90, *args)
    src = compiled.get_kernel_source()
    assert f"tma_store({out}_desc" in src and not re.search(rf"\b{out}\[", src)
    # the 32 KB tile takes these kernels to the sm_90 block limit
    _assert_tile_of_its_own(compiled, stage, 128 * 128 * 2, tmp_path)


def _assert_tile_of_its_own(compiled, stage: str, size: int, tmp_path) -> None:
    """The shared buffer ``stage`` of a compiled kernel has ``size`` bytes that no other
    buffer shares, and the kernel fits the sm_90 block: dynamic + static (the
    mbarriers, padded to the dynamic buffer's 1024-byte alignment) <= 227 KB."""
    spans = _shared_spans(compiled)
    lo, hi = spans[stage]
    overlapping = {name: span for name, span in spans.items()
                   if name != stage and span[0] < hi and lo < span[1]}
    assert hi - lo == size and not overlapping, (stage, spans)
    report = ptxas_report(compiled.get_kernel_source(), tmp_path)
    static = int(re.search(r"(\d+) bytes smem", report).group(1))
    dynamic = max(dynamic_smem(compiled.get_host_source()))
    assert dynamic + static <= _SM90_MAX_DYNAMIC_SMEM, (dynamic, static)


def test_fused_reverse_kernel_roles_keep_to_their_own_resources(tmp_path):
    """chunk_bwd_fused: four warpgroups by role meeting on mbarriers. Every shared buffer
    has bytes of its own (reuse is off: role blocks run at once) and they fit the sm_90
    block with the mbarriers; the cross-warp reductions (TileLang's, named barriers 1
    and 2) are all in the intra role's block, so no two roles meet on those ids; tiles
    load by TMA; ptxas keeps every WGMMA chain in flight."""
    builder, args = variant("bwd_fused")
    compiled = builder(SM90, *args)
    src = compiled.get_kernel_source()
    offsets = sorted((int(off), name) for name, off in re.findall(
        r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src))
    reductions = [name for _, name in offsets if name.startswith("workspace")]
    assert len(reductions) == 2                  # the intra role's two column sums
    spans = _shared_spans(compiled, allow=reductions)
    ends = [spans.get(name, (off, off + 1))[1] for off, name in offsets]
    assert all(end <= nxt for end, (nxt, _) in zip(ends, offsets[1:])), offsets
    report = ptxas_report(src, tmp_path)
    static = int(re.search(r"(\d+) bytes smem", report).group(1))
    dynamic = max(dynamic_smem(compiled.get_host_source()))
    assert dynamic + static <= _SM90_MAX_DYNAMIC_SMEM, (dynamic, static)
    assert "C7512" not in report and "serialized" not in report
    blocks = re.split(r"tl::warpgroup_reg_(?:alloc|dealloc)<(\d+)>", src)
    regs = [int(r) for r in blocks[1::2]]
    state, chain, intra, load = SM90.budget("chunk_bwd_fused")
    assert regs == [intra, chain, state, load]
    cross_warp = [len(re.findall(r"AllReduce<tl::SumOp, (?:64|128),", b)) for b in blocks[::2]]
    assert cross_warp[1] > 0 and sum(cross_warp) == cross_warp[1], cross_warp  # intra only
    assert src.count("__syncthreads()") == 1 and "tma_load" in src and "cp_async" not in src


@pytest.mark.parametrize(("kernel", "ctype"), [("fwd_ws_pool_bf16_v_first", "bfloat16_t"),
                                               ("fwd_ws_pool_fp32", "float")])
def test_pool_forward_reads_and_writes_only_the_pool(kernel, ctype):
    """chunk_fwd_ws on a state pool: the state is loaded from and stored to one pool
    argument (``final_state``, in the pool's dtype; the aliased ``initial_state`` is
    never read, so no two restrict pointers reach one row), at the slot ``seq_index[n]``
    loaded twice (before and after the chain, no register held across it), with a
    guard for negative slots on both sides."""
    builder, args = variant(kernel)
    src = _source(builder, *args)
    assert re.search(rf"{ctype}\*\s*__restrict__\s+final_state\b", src), src[:2000]
    assert "initial_state" not in src
    assert src.count("seq_index[") == 2
    assert "if (0 <= src) {" in src and "if (0 <= dst) {" in src
    assert "tl::wgmma_rs<" in src and _cta_barriers(src) == (2, 0)


@pytest.mark.parametrize("kernel", ["fwd_ws", "fwd_ws_warmup", "fwd_ws_pool_fp32"])
def test_o_leaves_by_tma_from_a_tile_of_its_own(kernel, tmp_path):
    """chunk_fwd_ws (WGMMA builds, no h tile): whole chunks of o leave by TMA from a
    shared [C, V] tile (``store_o_staged``) with bytes of its own (the roles run at once,
    so no buffer of the aux may share them), within the sm_90 block."""
    builder, args = variant(kernel)
    compiled = builder(SM90, *args)
    assert "tma_store(o_desc" in compiled.get_kernel_source()
    _assert_tile_of_its_own(compiled, "o_s", 64 * 128 * 2, tmp_path)


def test_states_only_forward_skips_o():
    """chunk_fwd_ws with ``states_only`` (the backward's recompute of h): four state
    WGMMAs per chunk ((K S0)^T, U^T's register and shared-memory halves, (U^T D) K), no
    Q K^T on the aux warpgroup, and o never written."""
    builder, args = variant("fwd_ws_states")
    src = _source(builder, *args)
    assert src.count("tl::wgmma_rs<") == 3 and src.count("tl::wgmma_ss<") == 1
    assert not re.search(r"\bo\[", src)


def test_aux_warpgroup_sweep_keeps_ds_in_registers(tmp_path):
    """chunk_bwd_dh_ws (the bounded split's, dS1 in q's dtype): the dS chain is
    register-A WGMMAs (dS1^T K^T, dU^T Ag, (E dX)^T K), the roles meet only on the slot
    mbarriers (the two CTA-wide barriers come before the roles split: the barriers'
    initialisation, and the staged dS1 tile's claim on its own bytes), the tiles load by
    TMA, and ptxas spills nothing at its setmaxnreg budgets (the forward's 208 / 88
    spilled here)."""
    builder, args = variant("bwd_dh_ws_warmup_dtype")
    src = _source(builder, *args)
    assert src.count("tl::wgmma_rs<") >= 3
    assert src.count("__syncthreads()") == 2
    assert src.count("].arrive()") == 4      # full, empty, loaded (first chunk's, loop's)
    assert "tma_load" in src and "cp_async" not in src
    assert "warpgroup_reg_alloc<192>" in src and "warpgroup_reg_dealloc<120>" in src
    assert re.search(r"\b0 bytes spill stores", ptxas_report(src, tmp_path))


@pytest.mark.parametrize("kernel", ["fwd_ws", "fwd_ws_warmup", "prepare", "bwd_intra",
                                    "fwd_ws_warmup_h_dtype", "bwd_dh_ws_dtype",
                                    "bwd_dh_ws_warmup_dtype",
                                    "fwd_ws_states", "fwd_ws_warmup_states_dtype",
                                    "fwd_ws_pool_bf16_v_first", "fwd_ws_pool_fp32"])
def test_wgmma_chains_are_not_serialised(kernel, tmp_path):
    """ptxas keeps the WGMMA k-steps of these kernels in flight together: no C7512
    ("wgmma.mma_async instructions are serialized"), which makes every 16-deep step wait
    for the previous one (chunk_fwd_ws had it at the plain 168 registers for 384
    threads: 30% of its state warpgroups' samples at those waits, Nsight Compute on the
    H200; its setmaxnreg budgets lift it)."""
    builder, args = variant(kernel)
    report = ptxas_report(_source(builder, *args), tmp_path)
    assert "Used" in report, report[-2000:]
    assert "C7512" not in report and "serialized" not in report


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_intra_kernel_compiles_to_wgmma(dtype):
    # one chunk per CTA, no loop to pipeline: guarded cp.async tile loads, WGMMA GEMMs
    from flash_qla_tl.kernels.chunk_input_grads import chunk_bwd_intra_kernel

    src = _source(chunk_bwd_intra_kernel, dtype, 128, 128)
    assert "wgmma" in src
    # dq / dk per value head in the input dtype
    ctype = {"bfloat16": "bfloat16_t", "float16": "half_t"}[dtype]
    assert re.search(rf"{ctype}\*\s*__restrict__\s+dq\b", src), src[:2000]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_group_sum_kernel_reads_and_writes_16_bytes(dtype):
    """The GVA sum is a bandwidth kernel: every load of the per-head grads and every
    store of the sum moves 16 bytes (8 elements) per thread, accumulated in fp32."""
    from flash_qla_tl.kernels.group_sum import group_sum_kernel

    src = _source(group_sum_kernel, dtype, 128)
    assert re.search(r"\*\(uint4\*\)\(x_local_cast", src), src[:3000]
    assert re.search(r"\*\(uint4\*\)\(out \+", src), src[:3000]
    assert "float acc[" in src


def test_intra_kernel_reductions_are_batched():
    """chunk_bwd_intra exchanges every row / column sum a thread owns in one AllReduce
    (one barrier pair), not one per element."""
    builder, args = variant("bwd_intra")
    src = _source(builder, *args)
    assert "AllReduce" in src and "::run_batch(" in src
    assert not re.search(r"AllReduce<[^;]*>::run\(", src)


# every variant above (each compiled once: the cache is per module)
_ALLVARIANTS = list(VARIANTS)


@pytest.mark.parametrize("kernel", _ALLVARIANTS)
def test_global_indexing_is_64_bit(kernel):
    """Offsets into token-sized tensors are computed in int64 in the generated CUDA, so
    inputs past 2^31 elements index correctly (issue: no 32-bit offset overflow)."""
    builder, args = variant(kernel)
    narrow = narrow_accesses(_source(builder, *args))
    assert not narrow, narrow


# the most dynamic shared memory one CTA may opt in to on sm_90 (227 KB)
_SM90_MAX_DYNAMIC_SMEM = SM90.smem_limit


@pytest.mark.parametrize("kernel", _ALLVARIANTS)
def test_shared_memory_fits_one_sm90_block(kernel):
    """Every kernel asks for at most 227 KB of dynamic shared memory, the sm_90 opt-in
    limit: past it the launch fails at run time ("Failed to set the allowed dynamic
    shared memory size"), which no compile step reports. TileLang gives every reduction
    its own workspace, so batching reductions (chunk_bwd_intra) can cross it."""
    builder, args = variant(kernel)
    sizes = dynamic_smem(builder(SM90, *args).get_host_source())
    assert sizes, "no kernel launch found: the pattern no longer matches the host code"
    assert max(sizes) <= _SM90_MAX_DYNAMIC_SMEM, sizes
