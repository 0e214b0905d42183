"""Compile-only helpers shared by the kernel compile tests (``tests/sm90/test_compile.py``,
``test_kernel_golden.py``, ``tests/portable/test_blackwell_compile.py``): lower a
builder's program for a target, run ptxas on the generated CUDA, and read the launch's
shared memory from TileLang's host code. TileLang and (for ptxas) nvcc needed, no GPU."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path


def lowered(builder, *args):
    """TileLang's artifact for ``builder(*args)`` (``args``: a kernel builder's static
    arguments, arch first) without running nvcc: the same lowering as
    ``tilelang.compile`` (the arch's target, its and the builder's pass configs)."""
    import tilelang
    import tvm

    arch = args[0]
    target = tvm.target.Target(arch.target_dict)
    with tvm.transform.PassContext(opt_level=3, config=arch.kernel_pass_configs(
            builder.pass_configs)), target:
        return tilelang.lower(builder.program(*args), target=target)


def lowered_source(builder, *args) -> str:
    """The CUDA text TileLang generates for ``builder(*args)`` (:func:`lowered`)."""
    return lowered(builder, *args).kernel_source


def lowered_dynamic_smem(artifact) -> int:
    """Dynamic shared memory bytes the launch of a lowered kernel asks for (0: none)."""
    (func,) = artifact.device_mod.functions.values()
    return int(func.attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in func.attrs \
        else 0


def normalised(src: str) -> str:
    """A generated kernel's CUDA text with TileLang's reduction workspaces renamed to one
    name: TileLang 0.1.15 names them (``workspace``, ``workspace_1``, ...) in an order
    that varies from run to run (``chunk_bwd_intra``: the same five row sums on
    ``workspace_3..7`` in another order per process, the declarations and offsets
    unchanged)."""
    return re.sub(r"\bworkspace(_\d+)?\b", "workspace_#", src)


def source_sha256(src: str) -> str:
    """sha256 of :func:`normalised` CUDA text."""
    return hashlib.sha256(normalised(src).encode()).hexdigest()


def ptxas_report(src: str, tmp_path: Path, arch: str = "sm_90a") -> str:
    """ptxas's verbose report for a generated kernel (nvcc -cubin for ``arch`` with the
    include paths TileLang compiles with)."""
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    from tests.conftest import _nvcc

    cu = tmp_path / f"kernel-{arch}.cu"
    cu.write_text(src)
    out = subprocess.run(
        [_nvcc(), "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(tmp_path / "k.cubin"),
         "--ptxas-options=-v", "-I" + CUTLASS_INCLUDE_DIR, "-I" + TILELANG_TEMPLATE_PATH,
         str(cu)], capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


def static_smem(report: str) -> int:
    """Static shared memory bytes (the mbarriers) of ptxas's report (0: none listed)."""
    found = re.search(r"(\d+) bytes smem", report)
    return int(found.group(1)) if found else 0


def spill_bytes(report: str) -> int:
    """Spill stores + loads in bytes of ptxas's report."""
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                              report).groups()
    return int(stores) + int(loads)


def dynamic_smem(host_src: str) -> list:
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


#: Per-sequence index tensors ([N + 1] or [NTmax, 2] entries) may be indexed in 32 bits.
SMALL = {"cu_seqlens", "chunk_offsets", "chunk_idx", "seq_start", "seq_index", "seq_end",
         "state_idx"}


def global_accesses(src: str):
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


def narrow_accesses(src: str) -> list:
    """Accesses to token-sized tensors whose offset is not computed in int64."""
    accesses = [(p, e) for p, e in global_accesses(src) if p not in SMALL]
    assert accesses, "no global access found: the pattern no longer matches the codegen"
    return [(p, e[:100]) for p, e in accesses if "int64_t" not in e]


_DIMS = ("bfloat16", 128, 128)
# name -> (module of flash_qla_tl.kernels, builder, static args after the arch): shipped
# variants (``precompile.variants``), bf16, K = V = 128; ``_h``: stores h
VARIANTS = {
    "recurrent_step": ("recurrent_step", "recurrent_step_kernel",
                       (*_DIMS, True, "float32", False, "float32")),
    "recurrent_step_pool_bf16_v_first": ("recurrent_step", "recurrent_step_kernel",
                                         (*_DIMS, True, "bfloat16", True, "bfloat16")),
    "prepare": ("chunk_cumsum_inverse", "chunk_prepare_kernel",
                        ("bfloat16", 128)),
    "fwd_ws": ("chunk_state_output", "chunk_fwd_ws_kernel", (*_DIMS, False, False)),
    "fwd_ws_h": ("chunk_state_output", "chunk_fwd_ws_kernel", (*_DIMS, True, True)),
    "fwd_ws_h_dtype": ("chunk_state_output", "chunk_fwd_ws_kernel",
                       (*_DIMS, True, True, False, True)),
    "fwd_ws_warmup": ("chunk_state_output", "chunk_fwd_ws_kernel",
                      (*_DIMS, True, False, True)),
    "fwd_ws_warmup_h_dtype": ("chunk_state_output", "chunk_fwd_ws_kernel",
                              (*_DIMS, True, True, True, True)),
    "fwd_ws_states": ("chunk_state_output", "chunk_fwd_ws_kernel",
                      (*_DIMS, True, True, False, True, True)),
    "fwd_ws_warmup_states_dtype": ("chunk_state_output", "chunk_fwd_ws_kernel",
                                   (*_DIMS, True, True, True, True, True)),
    "fwd_ws_pool_bf16_v_first": ("chunk_state_output", "chunk_fwd_ws_kernel",
                                 (*_DIMS, True, False, False, False, False, "bfloat16", True)),
    "fwd_ws_pool_fp32": ("chunk_state_output", "chunk_fwd_ws_kernel",
                         (*_DIMS, True, False, False, False, False, "float32", False)),
    "bwd_dh_ws_dtype": ("chunk_state_grad", "chunk_bwd_dh_ws_kernel",
                        (*_DIMS, True, False, True)),
    "bwd_dh_ws_warmup_dtype": ("chunk_state_grad", "chunk_bwd_dh_ws_kernel",
                               (*_DIMS, True, True, True)),
    "bwd_dh_ws_boundary": ("chunk_state_grad", "chunk_bwd_dh_ws_kernel",
                           (*_DIMS, True, True, False, True)),
    "bwd_intra": ("chunk_input_grads", "chunk_bwd_intra_kernel", _DIMS),
    "bwd_fused": ("chunk_grads_fused", "chunk_bwd_fused_kernel", (*_DIMS, True)),
    "bwd_fused_no_dht": ("chunk_grads_fused", "chunk_bwd_fused_kernel", (*_DIMS, False)),
    "group_sum": ("group_sum", "group_sum_kernel", ("bfloat16", 128)),
}


def variant(name: str) -> tuple:
    """``(builder, args)`` of a kernel variant the compile tests build, by name (the
    kernel module is imported here, not at collection)."""
    import importlib

    module, builder, args = VARIANTS[name]
    return getattr(importlib.import_module(f"flash_qla_tl.kernels.{module}"), builder), args
