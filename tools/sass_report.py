#!/usr/bin/env python3
"""SASS of one kernel variant (sm90 by default), on a machine without a GPU: what ptxas made of it.

Builds the variant's CUDA source with TileLang (cache hits are fine), compiles it for
the arch's target (``--arch``, default sm_90a) with nvcc (``-lineinfo``), disassembles
it with ``nvdisasm -gi`` and prints ptxas's registers / spills, the opcode histogram,
and the instructions per line of the generated CUDA (each instruction charged to the
outermost line of the kernel's own source that it was inlined into: a WGMMA or a
reduction counts at its call site).
Straight-line kernels (``chunk_bwd_intra``, ``chunk_prepare``) execute each
instruction once per thread, so the static count is also the per-thread work; loops
(the warp-specialised kernels) are per iteration where the line sits in the loop.

nvdisasm is not part of the CUDA toolkit's nvcc wheel: ``pip install
nvidia-cuda-nvdisasm`` (or pass ``--nvdisasm``). Usage, repo root::

    python3 tools/sass_report.py chunk_input_grads chunk_bwd_intra_kernel bfloat16 128 128 \\
        --top 25 [--save-cuda kernel.cu]
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_INSN = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)(.*)')
_INLINED = re.compile(r'inlined at "([^"]+)", line (\d+)')


def find_nvdisasm(explicit: str | None) -> str | None:
    """nvdisasm from ``explicit``, PATH, or the ``nvidia-cuda-nvdisasm`` wheel."""
    if explicit:
        return explicit
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return None
    for root in nvidia.__path__:
        for path in Path(root).glob("*/bin/nvdisasm"):
            return str(path)
    return None


def parse(sass: str, source_name: str) -> tuple[collections.Counter, dict]:
    """(opcode counts, {line of ``source_name``: Counter of opcodes}) of ``nvdisasm -gi``
    output; instructions outside any line of ``source_name`` are charged to line 0."""
    ops, per_line = collections.Counter(), collections.defaultdict(collections.Counter)
    line = 0
    for text in sass.splitlines():
        m = _LINE.search(text)
        if m:
            locs = [(m.group(1), int(m.group(2)))] + [
                (f, int(n)) for f, n in _INLINED.findall(m.group(3))]
            own = [n for f, n in locs if f.endswith(source_name)]
            line = own[-1] if own else 0
            continue
        m = _INSN.match(text)
        if m:
            op = m.group(1).split(".")[0]
            ops[op] += 1
            per_line[line][op] += 1
    return ops, per_line


def _arch(name: str):
    """The :class:`flash_qla_tl.arch.Arch` named ``name`` (see ``--arch``)."""
    from flash_qla_sm90.arch import SM90, proof_arch

    if name == "sm90":
        return SM90
    if name.startswith("proof-"):
        return proof_arch(name.removeprefix("proof-"))
    family = "sm100" if name in ("sm100", "sm103") else "sm120"
    arches = importlib.import_module(f"flash_qla_{family}.arch").ARCHES
    return next(arch for arch in arches if arch.name == name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module",
                    help="kernel module of flash_qla_tl.kernels, e.g. chunk_input_grads")
    ap.add_argument("builder", help="its kernel builder, e.g. chunk_bwd_intra_kernel")
    ap.add_argument("--arch", default="sm90",
                    help="sm90 (default), sm100, sm103, sm120, sm121, or proof-sm100 / "
                         "proof-sm120 (the H200 twins): the arch the kernel is built for")
    ap.add_argument("args", nargs="*", help="the builder's static arguments (Python literals "
                    "or bare strings: bfloat16 128 128 True)")
    ap.add_argument("--top", type=int, default=20, help="source lines listed (default 20)")
    ap.add_argument("--nvdisasm", help="path of nvdisasm (default: PATH or the wheel)")
    ap.add_argument("--save-cuda", type=Path, help="also write the generated CUDA here")
    a = ap.parse_args(argv)
    nvdisasm = find_nvdisasm(a.nvdisasm)
    if nvdisasm is None or shutil.which("nvcc") is None:
        print("error: needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)",
              file=sys.stderr)
        return 2
    sys.path[:0] = [str(REPO / f"packages/{package}/src") for package in (
        "flash-qla-tilelang", "flash-qla-sm90", "flash-qla-sm100", "flash-qla-sm120",
        "flash-qla-core")]
    arch = _arch(a.arch)
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    module = importlib.import_module(f"flash_qla_tl.kernels.{a.module}")
    args = []
    for text in a.args:
        try:
            args.append(ast.literal_eval(text))
        except (ValueError, SyntaxError):
            args.append(text)
    src = getattr(module, a.builder)(arch, *args).get_kernel_source()
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp, "kernel.cu"), Path(tmp, "kernel.cubin")
        cu.write_text(src)
        built = subprocess.run(
            ["nvcc", "-std=c++17", f"-arch={arch.target}", "-cubin", "-lineinfo", "-o", str(cubin),
             "--ptxas-options=-v", "-I" + CUTLASS_INCLUDE_DIR, "-I" + TILELANG_TEMPLATE_PATH,
             str(cu)], capture_output=True, text=True, check=True)
        sass = subprocess.run([nvdisasm, "-c", "-gi", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    if a.save_cuda:
        a.save_cuda.write_text(src)
    for text in (built.stdout + built.stderr).splitlines():
        if "Used" in text or "spill" in text:
            print(text.split(":", 1)[-1].strip())
    ops, per_line = parse(sass, "kernel.cu")
    print(f"instructions: {sum(ops.values())}")
    print("opcodes: " + " ".join(f"{op} {n}" for op, n in ops.most_common(24)))
    lines = src.splitlines()
    top = sorted(per_line.items(), key=lambda kv: -sum(kv[1].values()))[:a.top]
    for n, counts in top:
        where = lines[n - 1].strip()[:90] if 0 < n <= len(lines) else "(outside the kernel)"
        mix = " ".join(f"{op} {c}" for op, c in counts.most_common(4))
        print(f"{sum(counts.values()):6d}  line {n:5d}  [{mix}]  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
