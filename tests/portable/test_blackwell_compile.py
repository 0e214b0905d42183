"""The Blackwell packages' kernels compile for every Blackwell target (CPU: TileLang lowers
for an explicit target, ptxas compiles; no GPU).

For SM100 (``sm_100a``, ``sm_103a``) and SM120 (``sm_120a``, ``sm_121a``), each kernel
builder of ``flash_qla_tl.precompile.variants(arch)`` (by default its first bf16
variant; ``FLASH_QLA_FULL_COMPILE=1``, which CI sets: every variant, as ``nox -s build``
compiles them, each family's text lowered once and compiled for each of its targets):

- no ``wgmma`` (Hopper only) and no ``tcgen05`` (SM100 family only; none in the portable
  kernels) in the generated CUDA;
- ptxas compiles it for the target; dynamic + static shared memory fit the arch's limit
  (227 KB on SM100, 101,376 B on SM120); spills are recorded (junit property
  ``spill_bytes``) and may not exceed :data:`SPILL_BUDGET`;
- offsets into token-sized tensors are 64-bit;
- (each builder's first bf16 variant) the family's targets share one CUDA text
  (``sm_103a`` = ``sm_100a``, ``sm_121a`` = ``sm_120a``), and the Hopper proof build
  (``flash_qla_tl.arch.proof``, what the H200 runs under ``FLASH_QLA_PROOF_ARCH``) has
  the same mma.sync instantiations, ldmatrix, TMA, mbarrier and setmaxnreg calls and
  the same shared-memory layout;
- the fused reverse kernel's cross-warp reductions (named barriers 1 and 2) run in its
  intra role only.

Lowering only (``tests.kernel_build``), each (arch, variant) once per session: ~4 minutes
on 2 cores for the first variants; every variant: see the timing in the CI note.
"""

from __future__ import annotations

import collections
import functools
import os
import re

import pytest

tilelang = pytest.importorskip("tilelang", reason="TileLang is not installed")
pytestmark = [pytest.mark.nvcc]

from flash_qla_sm100.arch import SM100, SM103  # noqa: E402
from flash_qla_sm120.arch import SM120, SM121  # noqa: E402
from flash_qla_tl.arch import proof  # noqa: E402
from tests.kernel_build import (  # noqa: E402
    lowered,
    lowered_dynamic_smem,
    narrow_accesses,
    normalised,
    ptxas_report,
    spill_bytes,
    static_smem,
)

ARCHES = {arch.name: arch for arch in (SM100, SM103, SM120, SM121)}
#: each family's first arch: its CUDA text is the family's (checked below)
FAMILY = {"sm103": "sm100", "sm121": "sm120"}
#: instructions a portable kernel must not use (wgmma: Hopper only; tcgen05: SM100
#: family only; setmaxnreg compiles on every Blackwell target, docs/blackwell-plan.md)
HOPPER_OR_SM100_ONLY = ("wgmma", "tcgen05")
#: ptxas spill bytes (stores + loads) allowed per (family, builder): the most that
#: TileLang 0.1.15 and nvcc 13.0 gave over every shipped variant and target of the
#: family (2026-12-05) at SM90's setmaxnreg budgets, which were fitted to WGMMA (the
#: mma.sync chains also hold B fragments); a re-fit of the budgets lowers them.
SPILL_BUDGET = {
    ("sm100", "chunk_layout_kernel"): 0,
    ("sm100", "zero_tail_kernel"): 0,
    ("sm100", "recurrent_step_kernel"): 0,
    ("sm100", "group_sum_kernel"): 0,
    ("sm100", "chunk_prepare_kernel"): 0,
    ("sm100", "chunk_fwd_ws_kernel"): 116,          # sm_100a 116, sm_103a 36
    ("sm100", "chunk_bwd_dh_ws_kernel"): 0,
    ("sm100", "chunk_bwd_intra_kernel"): 512,
    ("sm100", "chunk_bwd_fused_kernel"): 768,       # sm_100a 696, sm_103a 768
    ("sm120", "chunk_layout_kernel"): 0,
    ("sm120", "zero_tail_kernel"): 0,
    ("sm120", "recurrent_step_kernel"): 0,
    ("sm120", "chunk_prepare_kernel"): 0,
    ("sm120", "chunk_fwd_ws_kernel"): 0,            # 32-token sub-chunks, no setmaxnreg
    ("sm120", "chunk_bwd_dh_ws_kernel"): 0,
    ("sm120", "chunk_bwd_intra_split_kernel"): 0,
    ("sm120", "group_sum_kernel"): 0,
}


def _full() -> bool:
    return os.environ.get("FLASH_QLA_FULL_COMPILE") == "1"


@functools.cache
def _variants(arch_name: str) -> tuple:
    """Every (builder, static args) ``precompile.variants`` ships for the arch."""
    from flash_qla_tl.precompile import variants

    return tuple(variants(ARCHES[arch_name]))


def _first_of_each_builder(arch_name: str) -> list[int]:
    """Indices (into :func:`_variants`) of each builder's first bf16 variant (the first
    variant of a builder without a dtype)."""
    first = {}
    for i, (builder, args) in enumerate(_variants(arch_name)):
        if args[1:2] in (("bfloat16",), ()):
            first.setdefault(builder.__name__, i)
    return list(first.values())


def _cases(every: bool) -> list:
    """(arch name, variant index) parameters: each builder's first bf16 variant, or
    (``every``) every variant. A variant's family members share an ``xdist_group``, so
    that ``pytest -n ... --dist loadgroup`` lowers its text once per family."""
    return [pytest.param(name, i, id=f"{name}-{_variants(name)[i][0].__name__}"
                                     f"{f'-{i}' if every else ''}",
                         marks=pytest.mark.xdist_group(f"{FAMILY.get(name, name)}-{i}"))
            for name in ARCHES
            for i in (range(len(_variants(name))) if every else _first_of_each_builder(name))]


@functools.cache
def _lowered(arch_name: str, index: int, proof_twin: bool = False):
    """(builder, args, artifact) of variant ``index`` of ``arch_name``, lowered once per
    session (``proof_twin``: the same variant built for ``proof(arch)``)."""
    arch = ARCHES[arch_name]
    builder, args = _variants(arch_name)[index]
    if proof_twin:
        arch = proof(arch)
        args = (arch, *args[1:])
    return builder, args, lowered(builder, *args)


@pytest.mark.parametrize("arch_name, index", _cases(_full()))
def test_compiles_within_the_arch_limits(arch_name, index, tmp_path, record_property):
    arch = ARCHES[arch_name]
    family = FAMILY.get(arch_name, arch_name)
    # every variant: a family member compiles its family's CUDA text for its own target
    # (the texts are one: test_family_targets_share_the_cuda_text, per builder)
    builder, args, art = _lowered(family if _full() else arch_name, index)
    src = art.kernel_source
    assert not [op for op in HOPPER_OR_SM100_ONLY if op in src]
    report = ptxas_report(src, tmp_path, arch.target)
    spilled = spill_bytes(report)
    record_property("spill_bytes", spilled)
    smem = lowered_dynamic_smem(art) + static_smem(report)
    record_property("smem_bytes", smem)
    assert smem <= arch.smem_limit, (smem, arch.smem_limit)
    assert spilled <= SPILL_BUDGET[family, builder.__name__], report[-600:]
    # group_sum's [G, M, K] rows and the chunk layout's offsets hold no token tensor
    if builder.__name__ not in ("group_sum_kernel", "chunk_layout_kernel"):
        assert not narrow_accesses(src)


@pytest.mark.parametrize("arch_name, index",
                         [p for p in _cases(False) if p.values[0] in FAMILY])
def test_family_targets_share_the_cuda_text(arch_name, index):
    _, _, art = _lowered(arch_name, index)
    _, _, first = _lowered(FAMILY[arch_name], index)
    assert normalised(art.kernel_source).replace(ARCHES[arch_name].target, "") == \
        normalised(first.kernel_source).replace(ARCHES[FAMILY[arch_name]].target, "")


#: What the H200 proof build must share with the Blackwell build (section 3 (e) of
#: docs/blackwell-plan.md): the tensor-core and data-movement instructions, the roles'
#: register budgets and the shared-memory layout. The rest may differ (SM >= 100 packs
#: fp32 math in pairs, fills shared memory with st.bulk).
_SHARED = (r"tl::mma_sync<[^>]*>", r"tl::ptx_ldmatrix_\w+", r"tl::ptx_stmatrix_\w+",
           r"tl::tma_load\(\w+", r"tl::tma_store\(\w+", r"\.init\(\d+\)", r"\]\.arrive\(\)",
           r"tl::warpgroup_reg_\w+<\d+>", r"buf_dyn_shmem \+ \d+")


def _signature(src: str) -> collections.Counter:
    return collections.Counter(m for pattern in _SHARED for m in re.findall(pattern, src))


@pytest.mark.parametrize("arch_name, index",
                         [p for p in _cases(False) if p.values[0] in ("sm100", "sm120")])
def test_proof_build_runs_the_same_instructions(arch_name, index):
    _, _, art = _lowered(arch_name, index)
    _, _, twin = _lowered(arch_name, index, proof_twin=True)
    assert "wgmma" not in twin.kernel_source
    assert _signature(art.kernel_source) == _signature(twin.kernel_source)
    assert lowered_dynamic_smem(art) == lowered_dynamic_smem(twin)


def test_fused_kernel_reduces_across_warps_in_its_intra_role_only():
    """TileLang's cross-warp reductions use named barriers 1 and 2: only one role may
    run them (mma.sync tiles are split by columns unless the products ask for whole
    rows, which ``chunk_grads_fused`` does for all of them: then no role has one)."""
    index = next(i for i, (b, _) in enumerate(_variants("sm100"))
                 if b.__name__ == "chunk_bwd_fused_kernel")
    src = _lowered("sm100", index)[2].kernel_source
    blocks = re.split(r"tl::warpgroup_reg_(?:alloc|dealloc)<\d+>", src)
    cross_warp = [len(re.findall(r"AllReduce<tl::SumOp, (?:64|128),", b)) for b in blocks]
    assert sum(cross_warp) == cross_warp[1], cross_warp                       # intra only


#: SM120 / SM121: 100 KB of shared memory per SM, 1 KB of it reserved per resident CTA
SM120_SMEM_PER_SM = 100 * 1024
SM120_RESERVED_PER_CTA = 1024


@pytest.mark.parametrize("arch_name", ["sm120", "sm121"])
def test_sm120_gradient_kernel_fits_two_ctas_per_sm(arch_name, tmp_path):
    """``chunk_bwd_intra_split`` is built for two CTAs per SM (a chain of short steps
    whose latencies the other CTA's warps hide): its launch bounds ask for two, and two
    fit the SM's shared memory and registers (<= 128 a thread at 256 threads) without
    spilling."""
    from flash_qla_tl.kernels.chunk_input_grads_split import CTAS_PER_SM
    from flash_qla_tl.kernels.traits import GRAD_THREADS

    index = next(i for i, (b, _) in enumerate(_variants(arch_name))
                 if b.__name__ == "chunk_bwd_intra_split_kernel")
    _, _, art = _lowered(arch_name, index)
    src = art.kernel_source
    assert CTAS_PER_SM == 2 and f"__launch_bounds__({GRAD_THREADS}, {CTAS_PER_SM})" in src
    report = ptxas_report(src, tmp_path, ARCHES[arch_name].target)
    smem = lowered_dynamic_smem(art) + static_smem(report)
    assert CTAS_PER_SM * (smem + SM120_RESERVED_PER_CTA) <= SM120_SMEM_PER_SM, smem
    (regs,) = map(int, re.findall(r"Used (\d+) registers", report))
    assert regs * GRAD_THREADS * CTAS_PER_SM <= 65536 and spill_bytes(report) == 0, \
        report[-600:]
