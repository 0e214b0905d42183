"""Compile-only helpers shared by the kernel compile tests (``tests/sm90/test_compile.py``,
``test_kernel_golden.py``, ``tests/portable/test_blackwell_compile.py``): lower a
builder's program for a target, run ptxas on the generated CUDA, and read the launch's
shared memory from TileLang's host code. TileLang and (for ptxas) nvcc needed, no GPU."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path


def lowered_source(builder, *args) -> str:
    """The CUDA text TileLang generates for ``builder(*args)`` (``args``: a kernel
    builder's static arguments, arch first) without running nvcc: the same lowering as
    ``tilelang.compile`` (the builder's target and pass configs), device code only."""
    import tilelang
    import tvm

    arch = args[0]
    target = tvm.target.Target(arch.target_dict)
    with tvm.transform.PassContext(opt_level=3, config=arch.kernel_pass_configs(
            builder.pass_configs)), target:
        return tilelang.lower(builder.program(*args), target=target).kernel_source


def source_sha256(src: str) -> str:
    """sha256 of a generated kernel's CUDA text, TileLang's reduction workspaces renamed
    to one name: TileLang 0.1.15 numbers them in an order that varies from run to run
    (``chunk_bwd_intra``: the same five row sums on ``workspace_3..7`` in another order
    per process, the declarations and offsets unchanged)."""
    return hashlib.sha256(re.sub(r"\bworkspace_\d+\b", "workspace_#", src).encode()).hexdigest()


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
    """Static shared memory bytes (the mbarriers) of ptxas's report."""
    return int(re.search(r"(\d+) bytes smem", report).group(1))


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
