"""The kernel index (CPU): a variant compiled once is found again by its builder and
static arguments, and a fresh process loads its compiled module without importing the
``tilelang`` package (what a first call in a new process saves); the index is keyed on
the kernel sources, so an edited kernel is never served from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

kernel_index = pytest.importorskip("flash_qla_tl.kernel_index",
                                   reason="TileLang is not installed")
from flash_qla_sm90.arch import SM90  # noqa: E402
from flash_qla_tl import kernels, launch  # noqa: E402

#: the cheapest shipped variant to compile (the GVA sum): a few seconds
VARIANT = (kernels.group_sum_kernel, (SM90, "bfloat16", 128))


@pytest.fixture(scope="module")
def indexed_cache(tmp_path_factory):
    """A TileLang cache holding VARIANT, compiled as ``precompile`` does (which indexes
    it) in a process of its own: a kernel this process built before (another test's
    cache) would come from TileLang's memory, filed under that other cache, and could
    not be indexed here. Compile-only, no GPU."""
    root = tmp_path_factory.mktemp("tilelang-cache")
    script = textwrap.dedent("""
        import sys
        from flash_qla_sm90.arch import SM90
        from flash_qla_tl import kernels, precompile
        precompile.variants = lambda arch: iter([(kernels.group_sum_kernel,
                                                   (SM90, "bfloat16", 128))])
        print(precompile._compile_slice((SM90,), sys.argv[1], 1, 0))
    """)
    env = {**os.environ, "TILELANG_PRINT_ON_COMPILATION": "0"}
    out = subprocess.run([sys.executable, "-c", script, str(root)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[-1] == "1", out.stderr[-2000:]
    mp = pytest.MonkeyPatch()
    mp.setenv("TILELANG_CACHE_DIR", str(root))
    yield root
    mp.undo()


def test_variant_name_depends_on_builder_and_arguments():
    from flash_qla_sm90.arch import proof_arch

    names = {kernel_index.variant_name("group_sum.group_sum_kernel", (SM90, "bfloat16", 128)),
             kernel_index.variant_name("group_sum.group_sum_kernel", (SM90, "float16", 128)),
             kernel_index.variant_name("group_sum.group_sum_kernel",
                                       (proof_arch("sm100"), "bfloat16", 128)),
             kernel_index.variant_name("recurrent_step.recurrent_step_kernel",
                                       (SM90, "bfloat16", 128))}
    assert len(names) == 4


def test_digest_follows_the_kernel_sources_and_tilelang_settings(monkeypatch):
    base = kernel_index.digest()
    monkeypatch.setattr(kernel_index, "_digest", None)
    assert kernel_index.digest() == base                    # deterministic
    monkeypatch.setattr(kernel_index, "_digest", None)
    monkeypatch.setenv("TILELANG_LAYOUT_COST_MODEL", "other")
    assert kernel_index.digest() != base                    # a setting TileLang keys on
    monkeypatch.setattr(kernel_index, "_digest", None)
    monkeypatch.delenv("TILELANG_LAYOUT_COST_MODEL")
    monkeypatch.setenv("TILELANG_PRINT_ON_COMPILATION", "1")
    assert kernel_index.digest() == base                    # a neutral one


@pytest.mark.nvcc
def test_compiled_variant_is_indexed_at_its_cache_entry(indexed_cache):
    builder, static = VARIANT
    entry = (indexed_cache / kernel_index.INDEX_DIR / kernel_index.digest()
             / kernel_index.variant_name(builder.index_name, static))
    folder = indexed_cache / entry.read_text()
    assert (folder / "manifest.json").is_file()
    assert any((folder / name).is_file() for name in kernel_index._LIBRARIES)
    assert kernel_index.load(builder.index_name, (SM90, "float16", 128)) is None  # not built


@pytest.mark.nvcc
def test_fresh_process_loads_indexed_kernel_without_tilelang(indexed_cache):
    """In a new process the launcher of VARIANT comes from the index: the compiled
    host module (its entry function present), TileLang's Python package not imported,
    the builder's module never imported."""
    script = textwrap.dedent("""
        import json, sys
        from flash_qla_sm90.arch import SM90
        from flash_qla_tl import kernels, launch
        module = launch.launcher(kernels.group_sum_kernel, SM90, "bfloat16", 128)
        print(json.dumps({
            "tilelang": "tilelang" in sys.modules,
            "builder_module": "flash_qla_tl.kernels.group_sum" in sys.modules,
            "type": type(module).__module__ + "." + type(module).__name__,
            "main": module.get_function("main", query_imports=True) is not None,
        }))
    """)
    env = {**os.environ, "TILELANG_CACHE_DIR": str(indexed_cache)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"tilelang": False, "builder_module": False,
                    "type": "tvm_ffi.module.Module", "main": True}, out.stderr


@pytest.mark.nvcc
def test_index_off_builds_through_tilelang(indexed_cache, monkeypatch):
    monkeypatch.setenv("FLASH_QLA_KERNEL_INDEX", "0")
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    assert kernel_index.load(VARIANT[0].index_name, VARIANT[1]) is None
    launch.launcher(*[VARIANT[0], *VARIANT[1]])
    assert "tilelang" in sys.modules


@pytest.mark.nvcc
def test_unloadable_entry_falls_back_to_tilelang(indexed_cache, monkeypatch):
    """An indexed entry whose host module does not load (a truncated file, a missing
    native runtime) is a miss, not an error: the launcher builds through TileLang."""
    builder, static = VARIANT
    assert kernel_index.load(builder.index_name, static) is not None

    def broken(path):
        raise RuntimeError("cannot load")
    import tvm_ffi
    monkeypatch.setattr(tvm_ffi, "load_module", broken)
    assert kernel_index.load(builder.index_name, static) is None
